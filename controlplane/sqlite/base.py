"""Django's SQLite backend, with this process's writers served first come, first served (see the
package's docstring for why). Named as the database ENGINE (`controlplane.sqlite`) in settings."""

from __future__ import annotations

import threading
import time
from collections import deque

from django.db.backends.sqlite3 import base as sqlite

from controlplane.sqlite import write_wait_seconds

# The statements that take SQLite's write lock when run outside a transaction.
_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "DROP", "ALTER")


class Turnstile:
    """A lock handed to waiters in the order they asked (Python's own lock promises no order: the
    thread that releases it may take it straight back). Re-entrant for the thread that holds it."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._waiting: deque[object] = deque()
        self._owner: int | None = None
        self._depth = 0

    def acquire(self, timeout: float) -> bool:
        me = threading.get_ident()
        with self._changed:
            if self._owner == me:
                self._depth += 1
                return True
            ticket = object()
            self._waiting.append(ticket)
            deadline = time.monotonic() + timeout
            try:
                while self._owner is not None or self._waiting[0] is not ticket:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._waiting.remove(ticket)
                        self._changed.notify_all()  # the next in line may be first now
                        return False
                    self._changed.wait(left)
            except BaseException:
                if ticket in self._waiting:
                    self._waiting.remove(ticket)
                    self._changed.notify_all()
                raise
            self._waiting.popleft()
            self._owner, self._depth = me, 1
            return True

    def release(self) -> None:
        with self._changed:
            if self._owner != threading.get_ident():
                return
            self._depth -= 1
            if not self._depth:
                self._owner = None
                self._changed.notify_all()

    @property
    def waiting(self) -> int:
        return len(self._waiting)


turnstile = Turnstile()


class TurnCursor(sqlite.SQLiteCursorWrapper):
    """A statement that writes outside a transaction takes its turn too (autocommit writes)."""

    wrapper: DatabaseWrapper

    def execute(self, query, params=None):
        if self.connection.in_transaction or not query.lstrip()[:7].upper().startswith(_WRITES):
            return super().execute(query, params)
        self.wrapper.take_turn()
        try:
            return super().execute(query, params)
        finally:
            self.wrapper.give_turn()

    def executemany(self, query, param_list):
        if self.connection.in_transaction or not query.lstrip()[:7].upper().startswith(_WRITES):
            return super().executemany(query, param_list)
        self.wrapper.take_turn()
        try:
            return super().executemany(query, param_list)
        finally:
            self.wrapper.give_turn()


class DatabaseWrapper(sqlite.DatabaseWrapper):
    _holds_turn = False
    _busy_ms: int | None = None

    def get_new_connection(self, conn_params):
        connection = super().get_new_connection(conn_params)
        self._busy_ms = round(conn_params.get("timeout", 5.0) * 1000)
        return connection

    def create_cursor(self, name=None):
        cursor = self.connection.cursor(factory=TurnCursor)
        cursor.wrapper = self
        return cursor

    def take_turn(self) -> None:
        """Wait for this process's earlier writers, at most the thread's `database_wait`; the same
        "database is locked" as SQLite's own when the wait runs out."""
        wait = write_wait_seconds(self.settings_dict["OPTIONS"].get("timeout", 5.0))
        if not turnstile.acquire(wait):
            with self.wrap_database_errors:
                raise sqlite.Database.OperationalError(
                    f"database is locked: no turn to write within {wait:g} s ({turnstile.waiting} writers waiting)"
                )
        self._holds_turn = True
        # SQLite's own wait, for a writer in another process (a host command), is as long.
        wanted = max(round(wait * 1000), 1)
        if wanted != self._busy_ms:
            self.connection.execute(f"PRAGMA busy_timeout = {wanted}")
            self._busy_ms = wanted

    def give_turn(self) -> None:
        if self._holds_turn:
            self._holds_turn = False
            turnstile.release()

    def _start_transaction_under_autocommit(self):
        self.take_turn()
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            self.give_turn()
            raise

    def _transaction_over(self) -> None:
        if self.connection is None or not self.connection.in_transaction:
            self.give_turn()

    def _commit(self):
        try:
            return super()._commit()
        finally:
            self._transaction_over()

    def _rollback(self):
        try:
            return super()._rollback()
        finally:
            self._transaction_over()

    def _set_autocommit(self, autocommit):
        super()._set_autocommit(autocommit)
        if autocommit:
            self._transaction_over()

    def _close(self):
        try:
            return super()._close()
        finally:
            self.give_turn()

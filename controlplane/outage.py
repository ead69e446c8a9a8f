"""The database away (or busy): how its failures are recognised, logged and answered.

Every request, stream and housekeeping round fails while the database is away, so one line per
failure (let alone a traceback) floods the log: 30 s without PostgreSQL under 50 agents once wrote
100,000 lines. Here each kind of failure is logged once per interval, with how many more there were,
and the first database connection after failures says once that the database is back.
"""

from __future__ import annotations

import logging
import random
import sqlite3
import threading
import time
from collections.abc import Callable

from django.db import InterfaceError

LOG_EVERY_SECONDS = 30.0
# A failure this soon after the database came back is a connection broken by the outage being used
# once more (a request already running), not a new outage: it is answered 503 and logs nothing.
SETTLE_SECONDS = 5.0
# Retry-After of a 503: chosen per answer in this range, so that a fleet told to come back does not
# come back all in the same second.
RETRY_AFTER_SECONDS = (5, 15)

# SQLSTATEs of a server that is gone or going: connection exceptions (class 08), shut down by the
# administrator or a crash, still starting up or shutting down.
_UNAVAILABLE_STATES = ("08", "57P01", "57P02", "57P03")
_SQLITE_UNAVAILABLE = ("unable to open database file", "disk i/o error")
# SQLite's one writer held the lock past the wait (controlplane/sqlite): the database is there, busy.
_SQLITE_BUSY = ("database is locked", "database table is locked", "database is busy")

log = logging.getLogger("palisade.database")


def database_unavailable(error: BaseException) -> bool:
    """True for a failure to reach the database at all (refused, dropped, shutting down); False for
    a failure of the statement itself (a constraint, a deadlock, a timeout), which is a fault to see."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, InterfaceError):  # "connection already closed"
            return True
        state = getattr(cause, "sqlstate", "-")
        if state != "-":  # a psycopg error: None when libpq failed before the server said anything
            if state is None:
                return _psycopg_operational(cause)
            return state.startswith(_UNAVAILABLE_STATES)
        if isinstance(cause, sqlite3.OperationalError):
            return str(cause).lower().startswith(_SQLITE_UNAVAILABLE)
        cause = cause.__cause__ or cause.__context__
    return False


def database_busy(error: BaseException) -> bool:
    """True for a write that waited its whole time for SQLite's lock: another writer held it (a long
    write that cannot be split, another process). Answered as the database away is, 503 with
    Retry-After (never a 500), but it is no outage: nothing is logged as one."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, sqlite3.OperationalError):
            return str(cause).lower().startswith(_SQLITE_BUSY)
        cause = cause.__cause__ or cause.__context__
    return False


def _psycopg_operational(error: BaseException) -> bool:
    import psycopg

    return isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError))


def retry_after_seconds() -> int:
    return random.randint(*RETRY_AFTER_SECONDS)  # noqa: S311 - spreading retries, not a secret


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class OutageLog:
    """One process's view of the database's availability, and the throttle of what it logs."""

    def __init__(self, every: float = LOG_EVERY_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.every, self.clock = every, clock
        self._lock = threading.Lock()
        self.down_since: float | None = None
        self.failures = 0
        self.recovered_at: float | None = None
        self.outages = 0  # how many began: a connection older than the last one may be dead
        self._last_logged: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def failed(self, what: str, error: BaseException, logger: logging.Logger | None = None) -> None:
        """`what` failed because the database is unavailable (`error`): at most one line per `what`
        and logger per interval, saying how many more failed the same way since the last line."""
        logger = logger or log
        now = self.clock()
        with self._lock:
            if self.down_since is None:
                if self.recovered_at is not None and now - self.recovered_at < SETTLE_SECONDS:
                    return
                self.down_since, self.failures = now, 0
                self.outages += 1
            self.failures += 1
            key = (logger.name, what)
            last = self._last_logged.get(key)
            if last is not None and now - last < self.every:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            more = self._suppressed.pop(key, 0)
            self._last_logged[key] = now
        since = f" ({more} more since the last line, {now - last:.0f} s ago)" if last is not None else ""
        logger.warning("database unavailable: cannot %s: %s%s", what, _first_line(error), since)

    def busy(self, what: str, error: BaseException, logger: logging.Logger | None = None) -> None:
        """`what` failed because the database was busy past its wait: at most one line per `what`
        and logger per interval, as for an outage, but the database is not marked away."""
        logger = logger or log
        now = self.clock()
        key = (logger.name, f"busy: {what}")
        with self._lock:
            last = self._last_logged.get(key)
            if last is not None and now - last < self.every:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            more = self._suppressed.pop(key, 0)
            self._last_logged[key] = now
        since = f" ({more} more since the last line, {now - last:.0f} s ago)" if last is not None else ""
        logger.warning("database busy: cannot %s: %s%s", what, _first_line(error), since)

    def available(self) -> None:
        """The database answered: said once after failures, then silent until the next outage."""
        if self.down_since is None:  # the usual case, without taking the lock
            return
        now = self.clock()
        with self._lock:
            if self.down_since is None:
                return
            down_for, failures = now - self.down_since, self.failures
            self.down_since, self.failures, self.recovered_at = None, 0, now
            self._last_logged.clear()
            self._suppressed.clear()
        log.warning("database available again after %.0f s (%d failures)", down_for, failures)

    @property
    def down(self) -> bool:
        return self.down_since is not None


outage = OutageLog()


def database_failed(what: str, error: BaseException, logger: logging.Logger | None = None) -> bool:
    """Log `error` as the database being away, or busy, when it is (throttled) and return True: the
    caller answers 503 with Retry-After (4503 on a stream). False when it is another failure, which
    the caller handles as it would have."""
    if database_busy(error):
        outage.busy(what, error, logger)
        return True
    if not database_unavailable(error):
        return False
    outage.failed(what, error, logger)
    return True


def _connected(sender, connection, **kwargs) -> None:
    outage.available()


def watch_connections() -> None:
    """Every new database connection is the database answering again (connection_created is sent
    once a connection is open and set up)."""
    from django.db.backends.signals import connection_created

    connection_created.connect(_connected, dispatch_uid="palisade.outage")

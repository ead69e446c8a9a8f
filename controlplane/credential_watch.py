"""Whether a flow report's headers that passed the body gate's check may pass again without the database.

The body gate (controlplane/body_gate.py) checks a report's headers before its body, and passes the same
workload and credential again for a few minutes without asking the database: the check cost serve more
CPU than the rest of a small report. A revocation must still take effect on the next header check, in
every serve process, whoever made it (the operator API of any process, a host command). So a pass is
trusted only while this process listens, on PostgreSQL, to the announcements of credential changes:
`fleet.credentials.credential_change_announce` sends one (NOTIFY, delivered when the revoking, renewing or
re-enrolling transaction commits, to every session listening then) and each one forgets the workload's
passes before the reactor handles anything after it.

- The listening connection is pinged every PING_SECONDS; passes are trusted until LIVE_SECONDS after the
  last answered ping. A connection that fails, or hangs, trusts nothing from then on: every report's
  headers are checked in the database until it listens again, and then every pass from before is
  forgotten (announcements may have been missed meanwhile).
- Everything the listening thread learns reaches the reactor's thread in order
  (controlplane/reactor_calls.py): a workload's passes are forgotten before the ping that follows its
  announcement renews the trust.
- On SQLite there is no such announcement (nor on PostgreSQL before serve runs): nothing is trusted, and
  every report's headers are checked in the database.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from controlplane.reactor_calls import reactor_call

log = logging.getLogger("palisade.http")

PING_SECONDS = 1.0
LIVE_SECONDS = 3.0  # passes are trusted until this long after the last answered ping
RETRY_SECONDS = 2.0  # between attempts to listen again
LOG_EVERY_SECONDS = 60.0
# How long a silent network may keep the listening connection before the kernel gives up on it (a
# hung connection is no longer trusted after LIVE_SECONDS anyway; this frees the thread to listen again).
TCP_USER_TIMEOUT_MS = 10_000


class CredentialWatch:
    """One serve process's subscription to credential changes. `changed(workload_id)` and `reset()` run on
    the reactor's thread (through `call`), as does `live()`."""

    def __init__(
        self,
        *,
        changed: Callable[[str], None],
        reset: Callable[[], None],
        call: Callable[..., None] = reactor_call,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.changed, self.reset, self.call, self.clock = changed, reset, call, clock
        self.alive_until = float("-inf")
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.logged_at = float("-inf")

    def live(self) -> bool:
        return self.clock() < self.alive_until

    def start(self) -> bool:
        """Listen on a thread of its own, on PostgreSQL; False (nothing trusted, ever) on SQLite."""
        from django.db import connections

        if connections["default"].vendor != "postgresql":
            log.info("SQLite: every flow report's headers are checked in the database before its body")
            return False
        self.thread = threading.Thread(target=self._run, name="credential-watch", daemon=True)
        self.thread.start()
        return True

    def stop(self) -> None:
        self.stopping.set()

    # On the listening thread.

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.listen(_connect())
            except Exception as error:  # noqa: BLE001 - whatever failed, trust nothing until listening again
                self._lost(error)
            self.stopping.wait(RETRY_SECONDS)

    def listen(self, connection) -> None:
        """Until stopped or the connection fails: forward each announcement, renew the trust at each ping."""
        from fleet.credentials import CREDENTIAL_CHANGES_CHANNEL

        try:
            connection.execute(f"LISTEN {CREDENTIAL_CHANGES_CHANNEL}")
            self.call(self.reset)  # what passed before this subscription may have been announced unheard
            log.info("listening for credential changes: flow report headers that passed are trusted again")
            while not self.stopping.is_set():
                connection.execute("SELECT 1")
                answered = self.clock()
                self._forward(connection.notifies(timeout=0))  # those that came with the ping's answer
                self.call(self._alive, answered + LIVE_SECONDS)
                self._forward(connection.notifies(timeout=PING_SECONDS))
        finally:
            connection.close()
            self._untrust()

    def _forward(self, notifies) -> None:
        for notify in notifies:
            self.call(self.changed, notify.payload)

    def _alive(self, until: float) -> None:
        if not self.stopping.is_set():
            self.alive_until = until

    def _untrust(self) -> None:
        self.alive_until = float("-inf")  # at once, from this thread
        self.call(setattr, self, "alive_until", float("-inf"))  # and after any ping still on its way

    def _lost(self, error: Exception) -> None:
        self._untrust()
        now = self.clock()
        if now - self.logged_at >= LOG_EVERY_SECONDS:
            self.logged_at = now
            log.warning(
                "not listening for credential changes (%s): every flow report's headers are checked in "
                "the database until it listens again",
                str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__,
            )


def _connect():
    """A connection of its own to the database Django uses, in autocommit, that notices a silent network."""
    import psycopg
    from django.db import connections

    params = connections["default"].get_connection_params()  # Django's own, not its connection
    if params.get("host") and not str(params["host"]).startswith("/"):
        params.update(keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=2)
        params["tcp_user_timeout"] = TCP_USER_TIMEOUT_MS
    return psycopg.connect(**params, autocommit=True)

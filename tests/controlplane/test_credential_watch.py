"""Which flow report headers pass the body gate again without the database (controlplane/body_gate.py's
PassedHeaders), and the credential watch that lets them (controlplane/credential_watch.py): on PostgreSQL,
a revocation, renewal or re-enrolment committed by any connection is heard, and the trust ends when the
listening connection does. The same through two real serve processes: tests/e2e/test_gateway_fair_shares.py."""

from __future__ import annotations

import queue
import time

import pytest
from django.db import connection

from controlplane.auth.actor import CLI_ACTOR
from controlplane.body_gate import PassedHeaders
from controlplane.credential_watch import LIVE_SECONDS, CredentialWatch
from fleet.credentials import credential_renew, credential_revoke
from tests.support.requirements import require
from tests.support.workloads import make_workload


def test_passes_are_trusted_only_while_heard_and_forgotten_by_their_owner():
    trusted = [True]
    passed = PassedHeaders(seconds=60, trusted=lambda: trusted[0])
    passed.remember(b"w1-a", "w1")
    passed.remember(b"w1-b", "w1")
    passed.remember(b"w2", "w2")
    assert passed.passed(b"w1-a") and passed.passed(b"w2")
    trusted[0] = False
    assert not passed.passed(b"w2")  # the watch stopped hearing: nothing passes without the database
    passed.remember(b"w3", "w3")
    trusted[0] = True
    assert not passed.passed(b"w3")  # nor is what was checked meanwhile remembered

    passed.forget("w1")  # w1's credential changed
    assert not passed.passed(b"w1-a") and not passed.passed(b"w1-b") and passed.passed(b"w2")

    # A check that read the database before a change and answers after it is not remembered.
    generation = passed.generation
    passed.forget("w9")
    passed.remember(b"w4", "w4", generation=generation)
    assert not passed.passed(b"w4")
    passed.remember(b"w4", "w4", generation=passed.generation)
    assert passed.passed(b"w4")
    passed.forget_all()
    assert not passed.until


class Heard:
    """What a watch tells the reactor, in the order it tells it (here on the watch's own thread)."""

    def __init__(self):
        self.events: queue.Queue = queue.Queue()
        self.watch = CredentialWatch(
            changed=lambda workload: self.events.put(("changed", workload)),
            reset=lambda: self.events.put(("reset", None)),
            call=lambda function, *args: function(*args),
        )

    def next(self, timeout: float = 10.0) -> tuple[str, str | None]:
        return self.events.get(timeout=timeout)

    def until_live(self, live: bool = True, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.watch.live() is not live:
            assert time.monotonic() < deadline, f"the watch is not {'live' if live else 'dead'}"
            time.sleep(0.02)


@pytest.mark.postgres
def test_the_watch_hears_every_committed_credential_change_and_trusts_nothing_once_it_stops_hearing(
    transactional_db,
):
    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    workload, other = make_workload(render=False), make_workload(render=False)
    heard = Heard()
    assert heard.watch.start()
    try:
        assert heard.next() == ("reset", None)
        heard.until_live()

        credential_renew(workload_id=str(workload.id))
        credential_revoke(actor=CLI_ACTOR, workload_id=str(other.id))
        assert [heard.next(), heard.next()] == [("changed", str(workload.id)), ("changed", str(other.id))]

        # Its connection ends: nothing is trusted until it listens again, and what passed before is
        # forgotten then (announcements made meanwhile went unheard).
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND (query LIKE 'LISTEN %' OR query = 'SELECT 1')"
            )
        heard.until_live(False, timeout=LIVE_SECONDS + 2)
        assert heard.next() == ("reset", None)
        heard.until_live()
    finally:
        heard.watch.stop()
        heard.watch.thread.join(10)
    assert not heard.watch.live()

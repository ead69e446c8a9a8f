"""The embedded SQLite backend (controlplane/sqlite): this process's writers take turns in the order
they asked, a write waits at most its thread's `database_wait`, and a wait that runs out (for this
process's writers, or SQLite's lock held by another process) is the database busy, which
controlplane/outage.py answers 503, not an outage. On a database file of the test's own, whatever the
test database is."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
from django.db import OperationalError, connections

from controlplane.api.errors import problem_from_exception
from controlplane.outage import database_busy, database_failed, database_unavailable, outage
from controlplane.sqlite import database_wait
from controlplane.sqlite.base import DatabaseWrapper, Turnstile


@pytest.fixture
def database(tmp_path, django_db_blocker):
    """Connections to one SQLite file through the backend, as serve's threads hold them (not the test
    database: pytest-django lets them open)."""
    path = tmp_path / "turns.sqlite3"
    with sqlite3.connect(path) as setup:
        setup.execute("PRAGMA journal_mode=WAL")
        setup.execute("CREATE TABLE t (n INTEGER)")
    configured = connections.configure_settings(
        {"default": {"ENGINE": "controlplane.sqlite", "NAME": str(path),
                     "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 5}}}
    )["default"]  # fmt: skip
    opened: list[DatabaseWrapper] = []

    def connect() -> DatabaseWrapper:
        wrapper = DatabaseWrapper(configured, "turns")
        wrapper.inc_thread_sharing()  # opened here, used on the test's threads
        opened.append(wrapper)
        return wrapper

    with django_db_blocker.unblock():
        yield connect, path
        for wrapper in opened:
            wrapper.close()


def _begin(wrapper: DatabaseWrapper) -> None:
    """What `transaction.atomic` does first on SQLite: BEGIN IMMEDIATE, after this process's turn."""
    wrapper.set_autocommit(False, force_begin_transaction_with_broken_autocommit=True)


def _end(wrapper: DatabaseWrapper) -> None:
    wrapper.commit()
    wrapper.set_autocommit(True)


def test_waiters_are_served_in_the_order_they_asked():
    turnstile = Turnstile()
    assert turnstile.acquire(1)
    order: list[int] = []

    def wait(n: int) -> None:
        assert turnstile.acquire(10)
        order.append(n)
        turnstile.release()

    threads = []
    for n in range(5):
        threads.append(threading.Thread(target=wait, args=(n,)))
        threads[-1].start()
        deadline = time.monotonic() + 5
        while turnstile.waiting < n + 1:  # queued before the next one asks
            assert time.monotonic() < deadline
            time.sleep(0.001)
    turnstile.release()
    for thread in threads:
        thread.join(10)
    assert order == [0, 1, 2, 3, 4]


def test_a_writer_that_lets_go_and_asks_again_at_once_waits_behind_those_already_waiting():
    """What SQLite's own wait (and Python's lock) allow: a writer committing and beginning again at
    once takes the lock back before the others wake, again and again."""
    turnstile = Turnstile()
    assert turnstile.acquire(1)
    order: list[str] = []
    waiter = threading.Thread(
        target=lambda: (turnstile.acquire(10), order.append("waiter"), turnstile.release())
    )
    waiter.start()
    while turnstile.waiting < 1:
        time.sleep(0.001)
    turnstile.release()
    assert turnstile.acquire(10)
    order.append("again")
    turnstile.release()
    waiter.join(10)
    assert order == ["waiter", "again"]


def test_a_wait_that_runs_out_leaves_the_line_and_those_behind_it_still_get_their_turn():
    turnstile = Turnstile()
    assert turnstile.acquire(1)
    assert turnstile.acquire(1)  # re-entrant for its holder
    turnstile.release()
    got: list[bool] = []
    impatient = threading.Thread(target=lambda: got.append(turnstile.acquire(0.05)))
    impatient.start()
    impatient.join(10)
    patient = threading.Thread(target=lambda: (got.append(turnstile.acquire(10)), turnstile.release()))
    patient.start()
    while turnstile.waiting < 1:
        time.sleep(0.001)
    turnstile.release()
    patient.join(10)
    assert got == [False, True] and turnstile.waiting == 0


def test_a_write_waiting_past_its_wait_for_this_processs_writer_is_the_database_busy(database):
    connect, _ = database
    writer, other = connect(), connect()
    _begin(writer)
    writer.cursor().execute("INSERT INTO t VALUES (1)")
    with database_wait(0.2), pytest.raises(OperationalError) as busy:
        other.cursor().execute("INSERT INTO t VALUES (2)")  # a write outside a transaction takes its turn too
    assert database_busy(busy.value) and not database_unavailable(busy.value)
    with database_wait(0.2), pytest.raises(OperationalError):
        _begin(other)
    _end(writer)
    _begin(other)  # its turn now
    other.cursor().execute("INSERT INTO t VALUES (3)")
    _end(other)
    assert [row[0] for row in other.cursor().execute("SELECT n FROM t ORDER BY n").fetchall()] == [1, 3]


def test_sqlites_lock_held_by_another_process_is_waited_for_as_long_then_busy(database):
    connect, path = database
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    wrapper = connect()
    reader = wrapper.cursor().execute("SELECT count(*) FROM t").fetchone()  # readers never wait (WAL)
    assert reader == (0,)
    with database_wait(0.2), pytest.raises(OperationalError) as busy:
        _begin(wrapper)
    assert database_busy(busy.value)
    holder.execute("ROLLBACK")
    _begin(wrapper)  # the turn was given back: the next write gets it
    _end(wrapper)


def test_the_database_busy_is_a_503_with_retry_after_and_no_outage(database, caplog):
    connect, path = database
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    with database_wait(0.1), pytest.raises(OperationalError) as busy:
        _begin(connect())
    holder.execute("ROLLBACK")
    problem = problem_from_exception(busy.value)
    assert problem is not None and (problem.name, problem.status) == ("service-unavailable", 503)
    assert 5 <= int(problem.headers["Retry-After"]) <= 15 and "busy" in problem.detail
    assert not outage.down  # busy is not away: nothing says the database came back later
    assert database_failed("do something", busy.value) and "database busy: cannot do something" in caplog.text
    assert "database unavailable" not in caplog.text
    assert not database_busy(OperationalError("no such table: t"))

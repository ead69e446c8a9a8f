"""serve's heavy workers (controlplane/heavy_pool.py) in the real serve: heavy requests are answered by
worker processes that serve starts and starts again when they die, exactly as serve would answer them
(authentication, the origin guard, problems, metrics); one running past its deadline is stopped with its
worker and its database statement; an answer over the bound is refused with the limit; the console's
heavy calls and exports go to the workers too. SQLite or PostgreSQL, whichever DATABASE_URL says; the
deadline needs PostgreSQL (a table lock makes a request wait as long as the test wants).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from contextlib import contextmanager

import pytest

from tests.support.requirements import require
from tests.support.serve_process import Site

pytestmark = pytest.mark.e2e

STARTED = re.compile(r"heavy worker (\d+) started")
RANGE = {"from": "2026-01-01T00:00:00Z", "to": "2026-01-01T01:00:00Z"}
PASSWORD = "heavy workers are separate processes"


def workers_started(serve, count: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        pids = [int(pid) for pid in STARTED.findall(serve.stderr_text())]
        if len(pids) >= count:
            return pids
        if time.monotonic() > deadline:
            raise AssertionError(f"{count} heavy workers not started:\n{serve.stderr_text()}")
        time.sleep(0.05)


def http_2xx(operator) -> float:
    text = operator.get("/metrics").text
    return float(
        re.search(
            r'^palisade_http_responses_total\{listener="operator",status_class="2xx"\} (\S+)$', text, re.M
        )[1]
    )


@pytest.fixture
def site(tmp_path):
    with Site.fresh(tmp_path / "data", migrated=True) as site:
        site.set_operator_password(PASSWORD)
        yield site


def test_heavy_requests_are_answered_by_workers_that_start_again_when_killed(site):
    serve = site.serve()
    first = workers_started(serve, 2)
    assert all(pid != serve.process.pid and os.path.exists(f"/proc/{pid}") for pid in first)
    with serve.client(headers={"Authorization": f"Bearer {serve.mint_operator_token()}"}) as operator:
        before = http_2xx(operator)
        rollup = operator.get("/api/v1/flows/rollup", params={**RANGE, "group_by": "peer"})
        assert rollup.status_code == 200 and rollup.json()["items"] == []
        # The worker ran Django's whole handler: its access line is in serve's log ...
        serve.wait_for_stderr(r"GET /api/v1/flows/rollup\?\S+ 200 [\d.]+ms operator")
        # ... and serve counted the answer, as it counts every answer it sends (the scrape itself, then this).
        assert http_2xx(operator) == before + 2

        # What serve's own handler would answer, the worker answers.
        bad = operator.post("/api/v1/policies/suggestions", json={"label_keys": [], "x": 1})
        assert bad.status_code == 422 and bad.json()["type"] == "urn:service:problem:validation"
        crossed = operator.post(
            "/api/v1/selectors/preview",
            json={"selector": "app=web"},
            headers={"Sec-Fetch-Site": "cross-site"},
        )
        assert crossed.status_code == 403 and crossed.json()["type"] == "urn:service:problem:cross-origin"
    with serve.client() as nobody:
        refused = nobody.post("/api/v1/policies/impact", json={})
        assert refused.status_code == 401 and refused.json()["type"] == "urn:service:problem:unauthenticated"
    with serve.client() as browser:  # a session cookie works there too
        assert browser.post("/api/v1/session", json={"password": PASSWORD}).status_code in (200, 201)
        assert browser.post("/api/v1/selectors/preview", json={"selector": "app=web"}).json()["count"] == 0

    for pid in first:
        os.kill(pid, signal.SIGKILL)
    for pid in first:
        serve.wait_for_stderr(rf"heavy worker {pid} exited \(killed by SIGKILL\); starting another")
    again = workers_started(serve, 4)[2:]
    assert set(again).isdisjoint(first)
    with serve.client(headers={"Authorization": f"Bearer {serve.mint_operator_token()}"}) as operator:
        assert operator.post("/api/v1/selectors/preview", json={"selector": ""}).status_code == 200
    assert serve.stop() == 0
    assert not any(os.path.exists(f"/proc/{pid}") for pid in again), "a worker outlived serve"
    assert "Traceback" not in serve.stderr_text()


def test_an_answer_over_the_bound_is_refused_with_the_limit(site):
    serve = site.serve(env={"PALISADE_HEAVY_MAX_ANSWER_BYTES": "1024"})
    # A preview echoes its selector: about 2,400 bytes of values make an answer over 1 KiB.
    long_selector = "app in (" + ", ".join(f"service-{n:03d}" for n in range(200)) + ")"
    with serve.client(headers={"Authorization": f"Bearer {serve.mint_operator_token()}"}) as operator:
        assert operator.post("/api/v1/selectors/preview", json={"selector": "app=web"}).status_code == 200
        refused = operator.post("/api/v1/selectors/preview", json={"selector": long_selector})
    assert refused.status_code == 422, refused.text
    assert refused.json() == {
        "type": "urn:service:problem:answer-too-large",
        "title": "Answer too large",
        "status": 422,
        "detail": refused.json()["detail"],
        "instance": "/api/v1/selectors/preview",
        "max_bytes": 1024,
    }
    assert "PALISADE_HEAVY_MAX_ANSWER_BYTES" in refused.json()["detail"]


@contextmanager
def flow_tables_locked(database_url: str):
    """Every flow table locked against reads, in a transaction held open until the block ends."""
    import psycopg

    with psycopg.connect(database_url) as conn:
        conn.execute(
            "LOCK TABLE flows_flowwindow, flows_flowgroup, flows_unsummedwindow, flows_flowblock, "
            "flows_flowhour, flows_flowquarter, flows_evidencegap IN ACCESS EXCLUSIVE MODE"
        )
        yield
        conn.rollback()


def lock_waiters(database_url: str) -> int:
    """The heavy workers' database sessions waiting on a lock."""
    import psycopg

    from controlplane.heavy_worker import APPLICATION_NAME

    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = %s AND wait_event_type = 'Lock'",
            [APPLICATION_NAME],
        ).fetchone()[0]


def wait_until(condition, what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def heavy_admitted(operator) -> float:
    return float(re.search(r"^palisade_heavy_requests (\S+)$", operator.get("/metrics").text, re.M)[1])


@pytest.mark.postgres
def test_heavy_requests_beyond_the_queue_are_refused_at_once_while_me_is_answered(site):
    require(site.database_url is not None, "needs PostgreSQL: set DATABASE_URL")
    serve = site.serve(env={"PALISADE_HEAVY_WORKERS": "1", "PALISADE_HEAVY_WAITING": "1"})
    workers_started(serve, 1)
    token = serve.mint_operator_token()
    answers: dict[str, object] = {}

    def rollup(name: str) -> None:
        with serve.client(headers={"Authorization": f"Bearer {token}"}) as own:
            answers[name] = own.get("/api/v1/flows/rollup", params={**RANGE, "group_by": "peer"})

    with serve.client(headers={"Authorization": f"Bearer {token}"}) as operator:
        with flow_tables_locked(site.database_url):
            running = threading.Thread(target=rollup, args=("running",))
            running.start()
            wait_until(
                lambda: lock_waiters(site.database_url) == 1, "the worker's statement waits on the lock"
            )
            waiting = threading.Thread(target=rollup, args=("waiting",))
            waiting.start()
            wait_until(lambda: heavy_admitted(operator) == 2, "the second request waits for the worker")
            # One worker busy, one request waiting: a third is refused at once, and /me is answered.
            busy = operator.get("/api/v1/flows/review", params=RANGE)
            assert busy.status_code == 429 and busy.json()["type"] == "urn:service:problem:rate-limited"
            assert busy.headers["Retry-After"] == "1"
            assert operator.get("/api/v1/me").status_code == 200
        running.join(30)
        waiting.join(30)
    assert answers["running"].status_code == 200 and answers["waiting"].status_code == 200


@pytest.mark.postgres
def test_a_heavy_request_past_its_deadline_is_stopped_with_its_worker_and_its_statement(site):
    require(site.database_url is not None, "needs PostgreSQL: set DATABASE_URL")
    serve = site.serve(env={"PALISADE_HEAVY_WORKERS": "1", "PALISADE_HEAVY_DEADLINE_SECONDS": "2"})
    first = workers_started(serve, 1)[0]
    with serve.client(headers={"Authorization": f"Bearer {serve.mint_operator_token()}"}) as operator:
        with flow_tables_locked(site.database_url):
            response = operator.get("/api/v1/flows/rollup", params={**RANGE, "group_by": "peer"})
            # The lock is still held: the database stopped the killed worker's statement itself.
            wait_until(lambda: lock_waiters(site.database_url) == 0, "the stopped statement ends")
        assert response.status_code == 504, response.text
        assert response.json()["type"] == "urn:service:problem:deadline-exceeded"
        assert response.json()["deadline_seconds"] == 2
        assert "PALISADE_HEAVY_DEADLINE_SECONDS" in response.json()["detail"]
        serve.wait_for_stderr(
            rf"heavy request /api/v1/flows/rollup ran past its 2 s deadline: worker {first} stopped "
            r"\(killed by SIGKILL\), another starts"
        )
        # The lock gone, the same request is answered by the worker started in place of the killed one.
        assert operator.get("/api/v1/flows/rollup", params={**RANGE, "group_by": "peer"}).status_code == 200
        assert first not in workers_started(serve, 2)[1:]


@pytest.mark.postgres
def test_the_consoles_heavy_reads_and_exports_go_to_the_workers(site):
    require(site.database_url is not None, "needs PostgreSQL: set DATABASE_URL")
    serve = site.serve(env={"PALISADE_HEAVY_DEADLINE_SECONDS": "2"})
    workers_started(serve, 2)
    with serve.client() as browser:
        assert browser.post("/login", data={"password": PASSWORD, "next": "/"}).status_code == 302
        assert browser.get("/review", params={"range": "1h"}).status_code == 200
        # The page's API call went through a worker's whole handler (serve's in-process calls log nothing).
        serve.wait_for_stderr(r"GET /api/v1/flows/review\?\S+ 200 [\d.]+ms operator")
        export = browser.get("/flows", params={"range": "1h", "export": "rollup"})
        assert export.status_code == 200 and export.headers["Content-Type"].startswith("text/csv")
        with flow_tables_locked(site.database_url):
            page = browser.get("/review", params={"range": "1h"})
            assert page.status_code == 200 and 'data-problem="deadline-exceeded"' in page.text
            stopped = browser.get("/flows", params={"range": "1h", "export": "rollup"})
            assert stopped.status_code == 504
            assert stopped.json()["type"] == "urn:service:problem:deadline-exceeded"

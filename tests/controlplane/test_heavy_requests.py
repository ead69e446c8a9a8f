"""Which requests are heavy, and how serve's HTTP layer and the console's client hand them to the heavy
workers: they wait for a worker (never on the threads every other request needs), and one more than the
pool admits is refused at once. The workers themselves run in the real serve: tests/e2e/
test_heavy_workers_on_serve.py."""

import asyncio
import json

import pytest
from django.test import Client

from controlplane import heavy_pool
from controlplane.heavy_pool import HeavyPool, is_heavy
from controlplane.http_threads import ThreadPoolHttp


def _scope(path: str, query: bytes = b"") -> dict:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "http_version": "1.1",
        "headers": [(b"authorization", b"Bearer x")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8080),
        "scheme": "https",
    }


async def _call(app: ThreadPoolHttp, path: str, body: bytes = b"") -> tuple[int, dict, bytes]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    await app(_scope(path), receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


@pytest.mark.parametrize(
    ("path", "query", "heavy"),
    [
        ("/api/v1/policies/render-dryrun", "", True),
        ("/api/v1/policies/impact", "", True),
        ("/api/v1/policies/suggestions", "", True),
        ("/api/v1/selectors/preview", "", True),
        ("/api/v1/flows/rollup", "group_by=peer", True),
        ("/api/v1/flows/review", "", True),
        ("/flows", "range=24h&export=rollup", True),  # the console's CSV of every row
        ("/flows", "range=24h", False),  # the page itself: its rollups go to the workers one by one
        ("/flows", "export=", False),
        ("/api/v1/flows", "workload=x", False),  # one page of one workload's windows
        ("/api/v1/flows/gaps", "", False),
        ("/api/v1/me", "", False),
        ("/api/v1/workloads", "", False),
    ],
)
def test_what_is_heavy(path, query, heavy):
    assert is_heavy(path, query) is heavy


def test_heavy_requests_wait_for_a_worker_and_overflow_is_refused_at_once():
    pool = HeavyPool(workers=1, waiting=1)  # not started: what it admits waits for a worker
    app = ThreadPoolHttp(threads=1, heavy=pool)
    app._respond = lambda environ: (200, [("Content-Type", "application/json")], b"{}")

    async def scenario():
        running = asyncio.ensure_future(_call(app, "/api/v1/policies/render-dryrun", b'{"rulesets": []}'))
        waiting = asyncio.ensure_future(_call(app, "/api/v1/flows/rollup"))
        while pool.jobs.qsize() < 2:
            await asyncio.sleep(0.01)
        # Both heavy places are taken: the ordinary pool still answers at once ...
        me = await asyncio.wait_for(_call(app, "/api/v1/me"), 2)
        # ... and one heavy request too many is refused, not queued.
        refused = await asyncio.wait_for(_call(app, "/api/v1/selectors/preview"), 2)
        jobs = [pool.jobs.get_nowait(), pool.jobs.get_nowait()]
        for job in jobs:  # as a worker would answer them
            assert job.future.set_running_or_notify_cancel()
            job.future.set_result(
                (200, [("Content-Type", "application/json")], b'{"path": "%s"}' % job.path.encode())
            )
        return me, refused, await running, await waiting, jobs

    me, refused, first, second, jobs = asyncio.run(scenario())
    assert me[0] == 200 and first[0] == 200 and second[0] == 200
    assert json.loads(first[2]) == {"path": "/api/v1/policies/render-dryrun"}
    # What crossed to the worker: the request's text environ and its body as received.
    environ = json.loads(jobs[0].head)
    assert (
        environ["PATH_INFO"] == "/api/v1/policies/render-dryrun"
        and environ["HTTP_AUTHORIZATION"] == "Bearer x"
    )
    assert jobs[0].body == b'{"rulesets": []}'
    status, headers, body = refused
    assert status == 429 and headers[b"retry-after"] == b"1" and headers[b"cache-control"] == b"no-store"
    assert headers[b"content-type"] == b"application/problem+json"
    assert json.loads(body)["type"] == "urn:service:problem:rate-limited"
    assert pool.admitted == 0


def test_a_heavy_request_whose_client_left_while_it_waited_is_never_run():
    pool = HeavyPool(workers=1, waiting=1)
    app = ThreadPoolHttp(threads=1, heavy=pool)

    async def scenario():
        call = asyncio.ensure_future(_call(app, "/api/v1/policies/suggestions"))
        while pool.jobs.qsize() < 1:
            await asyncio.sleep(0.01)
        call.cancel()  # daphne cancels the application when the client disconnects
        await asyncio.gather(call, return_exceptions=True)

    asyncio.run(scenario())
    job = pool.jobs.get_nowait()
    assert not job.future.set_running_or_notify_cancel()  # what a worker's slot checks before running it
    assert pool.admitted == 0


@pytest.mark.django_db
def test_the_consoles_heavy_calls_go_to_the_pool_and_its_other_calls_stay_in_process(operator_password):
    browser = Client()
    assert browser.post("/login", {"password": operator_password, "next": "/"}).status_code == 302
    pool = HeavyPool(workers=1, waiting=0)
    pool.admitted = pool.limit  # every place taken: a heavy call is refused without running
    heavy_pool.install(pool)
    try:
        page = browser.get("/review?range=1h")
        preview = browser.post("/policy/selector-preview", {"scope": "app=web"})
        fleet = browser.get("/")
    finally:
        heavy_pool.install(None)
    assert page.status_code == 200 and 'data-problem="rate-limited"' in page.content.decode()
    assert "Too many heavy requests" in preview.content.decode()
    assert fleet.status_code == 200  # no heavy call: the fleet page reads through the API in process


def test_a_worker_whose_serve_is_gone_leaves_quietly():
    """serve that fails to bind its port closes its workers' sockets before they are ready."""
    import os
    import socket
    import subprocess
    import sys

    ours, theirs = socket.socketpair()
    worker = subprocess.Popen(
        [sys.executable, "-m", "controlplane.heavy_worker", str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        stderr=subprocess.PIPE,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings"},
    )
    theirs.close()
    ours.close()
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0, stderr
    assert b"Traceback" not in stderr, stderr

"""Heavy requests (render dry-runs, selector previews) cannot hold the threads every other request needs."""

import asyncio
import json
import threading

from controlplane.http_threads import ThreadPoolHttp


def _scope(path: str) -> dict:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "http_version": "1.1",
        "headers": [],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8080),
        "scheme": "https",
    }


async def _call(app: ThreadPoolHttp, path: str) -> tuple[int, dict, bytes]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(_scope(path), receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


def test_heavy_requests_wait_on_their_own_pool_and_overflow_is_refused_at_once():
    release = threading.Event()
    app = ThreadPoolHttp(threads=1, heavy_threads=1, heavy_waiting=1)

    def respond(environ):
        if environ["PATH_INFO"] == "/api/v1/policies/render-dryrun":
            release.wait(10)
        return 200, [("Content-Type", "application/json")], b"{}"

    app._respond = respond

    async def scenario():
        running = asyncio.ensure_future(_call(app, "/api/v1/policies/render-dryrun"))
        waiting = asyncio.ensure_future(_call(app, "/api/v1/policies/render-dryrun"))
        await asyncio.sleep(0.05)
        # Both heavy places are taken: the ordinary pool still answers at once ...
        me = await asyncio.wait_for(_call(app, "/api/v1/me"), 2)
        # ... and one heavy request too many is refused, not queued.
        refused = await asyncio.wait_for(_call(app, "/api/v1/selectors/preview"), 2)
        release.set()
        return me, refused, await running, await waiting

    me, refused, first, second = asyncio.run(scenario())
    assert me[0] == 200 and first[0] == 200 and second[0] == 200
    status, headers, body = refused
    assert status == 429 and headers[b"retry-after"] == b"1"
    assert headers[b"content-type"] == b"application/problem+json"
    assert json.loads(body)["type"] == "urn:service:problem:rate-limited"
    assert app.heavy_admitted == 0

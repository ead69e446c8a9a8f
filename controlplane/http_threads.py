"""HTTP requests run Django's synchronous handler on a fixed pool of threads.

Django's ASGI handler hands one request between the event loop and fresh threads about ten times
and starts a thread (and so a database connection) per request; measured here that is four fifths of
a request's CPU time. Running the synchronous handler whole on a long-lived pool thread costs one
handoff, and lets each pool thread keep its database connection. Websockets stay on Channels.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor

from asgiref.wsgi import WsgiToAsgiInstance
from django.core.handlers.wsgi import WSGIHandler

from agent.protocol import FLOWS_PATH
from controlplane import metrics
from controlplane.listeners import body_limit
from controlplane.problems import Problem
from controlplane.response_headers import with_transport_security

POOL_THREADS = int(os.environ.get("PALISADE_HTTP_THREADS", 4))
# Requests whose work grows with the body and the fleet (a 400 KB render dry-run takes seconds of CPU)
# run on their own small pool, and only so many may wait: sixteen of them at once held every pool
# thread, and `GET /me` waited seconds behind them.
HEAVY_PATHS = frozenset(
    {
        "/api/v1/policies/render-dryrun",
        "/api/v1/policies/impact",
        "/api/v1/policies/suggestions",
        "/api/v1/selectors/preview",
    }
)
HEAVY_THREADS = int(os.environ.get("PALISADE_HEAVY_THREADS", 2))
HEAVY_WAITING = 8
# Agents' flow reports run on a pool of their own: a busy fleet's reports never hold the threads the
# operator API answers on, and the reports that wait together are written together (flows/services.py
# writes them in one transaction), so more threads here mean fewer, larger writes.
FLOW_REPORT_THREADS = int(os.environ.get("PALISADE_FLOW_REPORT_THREADS", 16))
LISTENER_KEY = "palisade.listener"


def _client_address(scope: dict) -> str:
    client = scope.get("client") or ("", 0)
    host = client[0] or ""
    # A dual-stack listener shows IPv4 clients as ::ffff:a.b.c.d; the address is a.b.c.d.
    return host[7:] if host.startswith("::ffff:") and "." in host else host


def _problem(problem: Problem, *, instance: str | None = None) -> tuple[int, list, bytes]:
    document = json.dumps(problem.document(instance=instance)).encode()
    return problem.status, [("Content-Type", "application/problem+json"), *problem.headers.items()], document


def _heavy_refusal(path: str) -> tuple[int, list, bytes]:
    problem = Problem(
        "rate-limited",
        "Too many render dry-runs and selector previews are running or waiting; retry in a second.",
        headers={"Retry-After": "1"},
        retry_after=1,
    )
    return _problem(problem, instance=path)


class ThreadPoolHttp:
    def __init__(
        self,
        threads: int = POOL_THREADS,
        heavy_threads: int = HEAVY_THREADS,
        heavy_waiting: int = HEAVY_WAITING,
        flow_report_threads: int = FLOW_REPORT_THREADS,
    ):
        self.handler = WSGIHandler()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="http")
        self.flow_report_pool = ThreadPoolExecutor(flow_report_threads, thread_name_prefix="http-flows")
        self.heavy_pool = ThreadPoolExecutor(heavy_threads, thread_name_prefix="http-heavy")
        self.heavy_admitted = 0  # running or queued; only the event loop's thread changes it
        self.heavy_limit = heavy_threads + heavy_waiting

    async def _run(self, environ: dict) -> tuple[int, list, bytes]:
        loop = asyncio.get_running_loop()
        path = environ.get("PATH_INFO", "")
        if path == FLOWS_PATH:
            return await loop.run_in_executor(self.flow_report_pool, self._respond, environ)
        if path not in HEAVY_PATHS:
            return await loop.run_in_executor(self.pool, self._respond, environ)
        if self.heavy_admitted >= self.heavy_limit:
            return _heavy_refusal(path)
        self.heavy_admitted += 1
        try:
            return await loop.run_in_executor(self.heavy_pool, self._respond, environ)
        finally:
            self.heavy_admitted -= 1

    def _respond(self, environ: dict) -> tuple[int, list, bytes]:
        started: list = []

        def start_response(status, headers, exc_info=None):
            started[:] = [status, headers]

        result = self.handler(environ, start_response)
        try:
            body = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close:
                close()
        status, headers = started
        return int(status.split(" ", 1)[0]), headers, body

    async def __call__(self, scope, receive, send):
        limit = body_limit(scope.get("path", ""))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= limit + 1:  # one byte over is enough for the size check to refuse it
                chunks.append(chunk)
            if not message.get("more_body"):
                break
        # serve admitted this body against its listener's budget (controlplane/body_gate.py); it is held
        # once here, not twice (the chunks and their join) while Django runs.
        joined, chunks = b"".join(chunks), []
        with io.BytesIO(joined) as body:
            del joined
            builder = WsgiToAsgiInstance(None)
            builder.scope = scope
            try:
                environ = builder.build_environ(scope, body)
            except ValueError:  # more duplicate headers than asgiref's limit
                status, headers, content = _problem(
                    Problem("malformed-request", "Too many duplicate headers.")
                )
            else:
                # A chunked body has no Content-Length header, and Django reads no further than it says.
                environ["CONTENT_LENGTH"] = str(size)
                environ[LISTENER_KEY] = scope.get("palisade_listener", "operator")
                environ["REMOTE_ADDR"] = _client_address(scope)
                status, headers, content = await self._run(environ)
        metrics.http_answered(scope.get("palisade_listener", "operator"), status)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (name.lower().encode("latin1"), value.encode("latin1"))
                    for name, value in with_transport_security(headers)
                ],
            }
        )
        await send({"type": "http.response.body", "body": content})

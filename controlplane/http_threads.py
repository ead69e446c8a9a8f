"""HTTP requests run Django's synchronous handler on a fixed pool of threads, or in a heavy worker.

Django's ASGI handler hands one request between the event loop and fresh threads about ten times
and starts a thread (and so a database connection) per request; measured here that is four fifths of
a request's CPU time. Running the synchronous handler whole on a long-lived pool thread costs one
handoff, and lets each pool thread keep its database connection. Websockets stay on Channels.

Heavy requests (controlplane/heavy_pool.py: work that grows with the stored flows, the fleet or the
body) never run in this process: they go to serve's worker processes, whose answers come back here.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor

from asgiref.wsgi import WsgiToAsgiInstance
from django.core.handlers.wsgi import WSGIHandler

from agent.protocol import FLOWS_PATH
from controlplane import metrics
from controlplane.heavy_pool import HEAVY_PATHS, HeavyPool, busy_answer, django_answer, is_heavy
from controlplane.listeners import body_limit
from controlplane.problems import Problem
from controlplane.response_headers import with_transport_security

__all__ = ["HEAVY_PATHS", "ThreadPoolHttp"]

POOL_THREADS = int(os.environ.get("PALISADE_HTTP_THREADS", 4))
# Agents' flow reports run on a pool of their own: a busy fleet's reports never hold the threads the
# operator API answers on, and the reports that wait together are written together (flows/services.py
# writes them in one transaction), so more threads here mean fewer, larger writes.
FLOW_REPORT_THREADS = int(os.environ.get("PALISADE_FLOW_REPORT_THREADS", 16))
LISTENER_KEY = "palisade.listener"


def _client_address(scope: dict) -> str:
    client = scope.get("client") or ("", 0)
    return client_host(client[0] or "")


def client_host(host: str) -> str:
    # A dual-stack listener shows IPv4 clients as ::ffff:a.b.c.d; the address is a.b.c.d.
    return host[7:] if host.startswith("::ffff:") and "." in host else host


def _problem(problem: Problem, *, instance: str | None = None) -> tuple[int, list, bytes]:
    document = json.dumps(problem.document(instance=instance)).encode()
    return problem.status, [("Content-Type", "application/problem+json"), *problem.headers.items()], document


class ThreadPoolHttp:
    # The instance serve answers with: its flow-report pool also takes the reports that serve's
    # requests hand it without the ASGI application (controlplane/plain_reports.py, `PlainReportRequest`).
    serving: ThreadPoolHttp | None = None

    def __init__(
        self,
        threads: int = POOL_THREADS,
        flow_report_threads: int = FLOW_REPORT_THREADS,
        heavy: HeavyPool | None = None,
    ):
        self.handler = WSGIHandler()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="http")
        self.flow_report_pool = ThreadPoolExecutor(flow_report_threads, thread_name_prefix="http-flows")
        self.heavy = heavy  # None: heavy requests run on the pool threads (no workers in this process)
        ThreadPoolHttp.serving = self

    def flow_report_submit(self, environ: dict) -> Future:
        """A flow report's answer, on the flow-report pool: (status, headers, body), as `_run` gives."""
        return self.flow_report_pool.submit(self._respond_to_report, environ)

    async def _run(self, environ: dict) -> tuple[int, list, bytes]:
        loop = asyncio.get_running_loop()
        path = environ.get("PATH_INFO", "")
        if path == FLOWS_PATH:
            return await loop.run_in_executor(self.flow_report_pool, self._respond_to_report, environ)
        if self.heavy is None or not is_heavy(path, environ.get("QUERY_STRING", "")):
            return await loop.run_in_executor(self.pool, self._respond, environ)
        answer = self.heavy.submit(environ, environ["wsgi.input"].read())
        if answer is None:
            return busy_answer(path)
        return await asyncio.wrap_future(answer)

    def _respond(self, environ: dict) -> tuple[int, list, bytes]:
        return django_answer(self.handler, environ)

    def _respond_to_report(self, environ: dict) -> tuple[int, list, bytes]:
        from controlplane.gateway_reports import flow_report_answer

        answer = flow_report_answer(environ)
        return django_answer(self.handler, environ) if answer is None else answer

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

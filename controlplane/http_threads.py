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
from django.conf import settings
from django.core.handlers.wsgi import WSGIHandler

from controlplane.problems import Problem

POOL_THREADS = int(os.environ.get("PALISADE_HTTP_THREADS", 4))
LISTENER_KEY = "palisade.listener"


def _client_address(scope: dict) -> str:
    client = scope.get("client") or ("", 0)
    host = client[0] or ""
    # A dual-stack listener shows IPv4 clients as ::ffff:a.b.c.d; the address is a.b.c.d.
    return host[7:] if host.startswith("::ffff:") and "." in host else host


def _problem(problem: Problem) -> tuple[int, list, bytes]:
    document = json.dumps(problem.document()).encode()
    return problem.status, [("Content-Type", "application/problem+json")], document


class ThreadPoolHttp:
    def __init__(self, threads: int = POOL_THREADS):
        self.handler = WSGIHandler()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="http")

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
        limit = settings.PALISADE_MAX_BODY_BYTES
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
        with io.BytesIO(b"".join(chunks)) as body:
            builder = WsgiToAsgiInstance(None)
            builder.scope = scope
            try:
                environ = builder.build_environ(scope, body)
            except ValueError:  # more duplicate headers than asgiref's limit
                status, headers, content = _problem(Problem("malformed-request", "Too many duplicate headers."))
            else:
                if size > limit:
                    environ["CONTENT_LENGTH"] = str(size)  # a chunked body: let the size check see it
                environ[LISTENER_KEY] = scope.get("palisade_listener", "operator")
                environ["REMOTE_ADDR"] = _client_address(scope)
                loop = asyncio.get_running_loop()
                status, headers, content = await loop.run_in_executor(self.pool, self._respond, environ)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(name.lower().encode("latin1"), value.encode("latin1")) for name, value in headers],
            }
        )
        await send({"type": "http.response.body", "body": content})

"""A plain flow report past daphne's ASGI application: the scope, the application's task and queues,
and the handoffs between the event loop, the application and Twisted cost about a third of the reactor
thread's time per report. Twisted's request is handed straight to the flow-report threads (whose answer
is controlplane/gateway_reports.py's), and their answer written back as daphne writes an
application's. Any request that is not a plain flow report is daphne's, as before."""

from __future__ import annotations

import io
import logging
import time
from concurrent.futures import Future

from agent import protocol
from controlplane import metrics
from controlplane.http_threads import LISTENER_KEY, ThreadPoolHttp, client_host
from controlplane.listeners import GATEWAY, body_limit, listener_for_port
from controlplane.reactor_calls import reactor_call
from controlplane.response_headers import with_transport_security

FLOWS_URI = protocol.FLOWS_PATH.encode()
_log = logging.getLogger("palisade.serve")


class PlainReportRequest:
    """Mixed into daphne's request class (controlplane/http_limits.py). A plain flow report (as
    `flow_report_answer` takes, and with nothing daphne itself would refuse or treat otherwise) goes
    from Twisted to the flow-report threads, and its answer back to Twisted, without an ASGI
    application: the same environ as the application would build for it, the same answer, the same
    metrics. Any other request is daphne's, as before."""

    def process(self):
        environ = _plain_report_environ(self)
        serving = ThreadPoolHttp.serving
        if environ is None or serving is None:
            return super().process()  # type: ignore[misc]
        # What daphne's process() sets that its answer and its bookkeeping read.
        self.request_start = time.time()
        self.client_addr = [str(self.client.host), self.client.port]
        self.server_addr = [str(self.host.host), self.host.port]
        future = serving.flow_report_submit(environ)
        future.add_done_callback(lambda done: reactor_call(self._report_answered, done))
        return None

    def _report_answered(self, future: Future) -> None:
        try:
            status, headers, content = future.result()
        except Exception:  # noqa: BLE001 - as daphne answers an application that raised
            _log.exception("Exception inside the flow report's answer")
            self.handle_exception(None)
            return
        metrics.http_answered(GATEWAY, status)
        # daphne's own writing of an application's answer: it does nothing once the client is gone.
        self.handle_reply(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (name.lower().encode("latin1"), value.encode("latin1"))
                    for name, value in with_transport_security(headers)
                ],
            }
        )
        self.handle_reply({"type": "http.response.body", "body": content})


def _plain_report_environ(request) -> dict | None:
    """The WSGI environ controlplane/http_threads.py builds for a plain flow report, None for any other
    request (or one daphne answers itself: a header it refuses, an upgrade, a proxy's headers)."""
    from daphne.utils import HEADER_NAME_RE, INVALID_HEADER_VALUE_BYTES

    if (
        request.method != b"POST"
        or request.uri != FLOWS_URI  # the path as given: no query, no escapes
        or request.server.proxy_forwarded_address_header
        or listener_for_port(request.host.port) != GATEWAY
    ):
        return None
    environ: dict = {
        "REQUEST_METHOD": "POST",
        "SCRIPT_NAME": "",
        "PATH_INFO": protocol.FLOWS_PATH,
        "QUERY_STRING": "",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.url_scheme": "https",
        LISTENER_KEY: GATEWAY,
        "REMOTE_ADDR": client_host(str(request.client.host)),
    }
    for name, values in request.requestHeaders.getAllRawHeaders():
        if not HEADER_NAME_RE.fullmatch(name) or any(
            INVALID_HEADER_VALUE_BYTES.intersection(v) for v in values
        ):
            return None
        name = name.lower()
        if b"_" in name or name == b"daphne-root-path":  # daphne leaves these out of the scope
            continue
        if name in (b"upgrade", b"origin", b"sec-fetch-site"):  # Django's to answer
            return None
        key = name.decode("latin1").upper().replace("-", "_")
        key = key if key in ("CONTENT_LENGTH", "CONTENT_TYPE") else "HTTP_" + key
        for value in values:  # repeated headers joined, as asgiref does
            text = value.decode("latin1")
            environ[key] = environ[key] + "," + text if key in environ else text
    request.content.seek(0, 0)
    body = request.content.read(body_limit(protocol.FLOWS_PATH) + 1)
    if len(body) > body_limit(protocol.FLOWS_PATH):
        return None
    environ["CONTENT_LENGTH"] = str(len(body))  # what was received, as http_threads.py sets it
    environ["wsgi.input"] = io.BytesIO(body)
    return environ

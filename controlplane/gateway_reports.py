"""serve's own answer to a flow report (POST /agent/v1/flows on the gateway listener), without Django's
handler, middleware and DRF: that machinery cost a fifth of serve's CPU per report, for a request
whose every step is known. What the report's answer is, is flows/gateway.py's (`flow_report_take`, the
view's too); this is the HTTP around it, as the middleware and DRF would make it.

Such a request does not go through daphne's ASGI application either: controlplane/plain_reports.py.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping

from django.db import close_old_connections

from agent import protocol
from controlplane import metrics
from controlplane.api.errors import exception_handler
from controlplane.body_gate import PassedHeaders, passed_headers
from controlplane.console.security import CONTENT_SECURITY_POLICY
from controlplane.listeners import GATEWAY, body_limit
from controlplane.response_headers import NO_STORE
from fleet.report_auth import ReportSender
from flows.gateway import FlowReportView, flow_report_take, report_sender_of

access_log = logging.getLogger("palisade.access")


def report_sender_passed(headers: Mapping[str, str]) -> ReportSender:
    """The sender as the body gate found it, while its pass holds (this process hears of every
    credential change: controlplane/body_gate.py), else checked now in the database. Either way the
    write checks the sender's credential again, under its workload's lock, in the transaction that
    stores the report (`flows.services`): a change made since refuses the report."""
    sender = passed_headers.passed_value(PassedHeaders.key(protocol.FLOWS_PATH, FlowReportView, headers))
    return sender if isinstance(sender, ReportSender) else report_sender_of(headers)


# Only the plain case is taken (a POST on the gateway listener, without the headers a browser adds or a
# query, within the body limit): anything else goes the whole way, through `FlowReportView`, and is
# answered as before. The answer carries what the middleware and DRF add to the view's (tests/e2e
# compare the two).
ANSWER_HEADERS = (
    ("Allow", "POST, OPTIONS"),
    ("X-Frame-Options", "DENY"),
    ("X-Content-Type-Options", "nosniff"),
    ("Content-Security-Policy", CONTENT_SECURITY_POLICY),
    ("Referrer-Policy", "same-origin"),
    NO_STORE,
    ("Cross-Origin-Opener-Policy", "same-origin"),
)
TIDY_SECONDS = 10.0  # as the body gate's check threads: Django's per-request tidying, once in a while
_thread = threading.local()


class _Headers(Mapping[str, str]):
    """A request's headers from its WSGI environ, read by name in any case (as `request.headers`)."""

    def __init__(self, environ: dict):
        self.environ = environ

    def __getitem__(self, name: str) -> str:
        return self.environ["HTTP_" + name.upper().replace("-", "_")]

    def __iter__(self):
        return (k[5:].replace("_", "-").title() for k in self.environ if k.startswith("HTTP_"))

    def __len__(self) -> int:
        return sum(1 for k in self.environ if k.startswith("HTTP_"))


class _Request:
    """What the API's exception handler reads of a request: its method and path."""

    method = "POST"
    path = protocol.FLOWS_PATH


def flow_report_answer(environ: dict) -> tuple[int, list[tuple[str, str]], bytes] | None:
    """The answer to a flow report, or None for a request that Django answers (see above)."""
    if (
        environ.get("palisade.listener") != GATEWAY
        or environ.get("REQUEST_METHOD") != "POST"
        or "HTTP_ORIGIN" in environ
        or "HTTP_SEC_FETCH_SITE" in environ
        or environ.get("QUERY_STRING")  # the access log's line shows it as Django writes it
    ):
        return None
    length = environ.get("CONTENT_LENGTH") or "0"
    if not length.isdigit() or int(length) > body_limit(protocol.FLOWS_PATH):
        return None
    started = time.perf_counter()
    _connection_tidy()
    try:
        headers = _Headers(environ)
        answer = flow_report_take(
            headers, lambda: environ["wsgi.input"].read(int(length)), sender=report_sender_passed(headers)
        )
    except Exception as error:  # noqa: BLE001 - every refusal is a problem document, as the view's
        _thread.tidied_at = -TIDY_SECONDS  # look at the connection before the next report
        response = exception_handler(error, {"request": _Request})
        status, content = response.status_code, response.content
        headers = [(name, value) for name, value in response.items() if name != "Content-Length"]
        metrics.flow_report_answered(response)
        logged = not getattr(response, "database_unavailable", False)
    else:
        status, headers, logged = 200, [("Content-Type", "application/json")], True
        # As DRF's JSONRenderer writes it.
        content = json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    present = {name.lower() for name, _ in headers}
    headers += [(name, value) for name, value in ANSWER_HEADERS if name.lower() not in present]
    headers.append(("Content-Length", str(len(content))))
    if logged:  # as AccessLogMiddleware's line
        access_log.info(
            "%s %s %s %.1fms %s %s",
            "POST",
            protocol.FLOWS_PATH,
            status,
            (time.perf_counter() - started) * 1000,
            GATEWAY,
            environ.get("REMOTE_ADDR", "-"),
        )
    return status, headers, content


def _connection_tidy() -> None:
    """What Django does around each request (close_old_connections: the connection's age, and its
    health with CONN_HEALTH_CHECKS), done once every TIDY_SECONDS and after a failure: its health
    check is a round trip of its own."""
    now = time.monotonic()
    if now - getattr(_thread, "tidied_at", -TIDY_SECONDS) >= TIDY_SECONDS:
        close_old_connections()
        _thread.tidied_at = now

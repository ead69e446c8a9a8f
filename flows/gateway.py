"""POST /agent/v1/flows on the gateway listener: an agent's signed flow report, answered per window
and gap. Refusals of the whole report (authentication, a malformed envelope) are problem documents.

serve checks a report's headers before it receives the body (`headers_check`, run by
controlplane/body_gate.py, which passes the same `headers_check_key` again for a few minutes without
asking, until the workload's credential changes): a sender that is not an enrolled workload with its
current credential is refused without its body being read, and a workload has one report body in flight
at a time (`body_owner`). The view takes the sender as the gate found it while that pass holds (else it
checks the headers in the database), then checks the body's signature; the write checks the sender's
credential once more, under its workload's lock (a revocation made meanwhile refuses the report)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping

from django.db import close_old_connections
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from agent import protocol
from controlplane import metrics
from controlplane.api.errors import exception_handler
from controlplane.body_gate import PassedHeaders, passed_headers
from controlplane.console.security import CONTENT_SECURITY_POLICY
from controlplane.listeners import GATEWAY, body_limit
from controlplane.problems import Problem
from controlplane.response_headers import NO_STORE
from controlplane.strict_json import json_loads_strict
from fleet.credentials import workload_key
from fleet.report_auth import ReportSender, report_sender_authenticate, report_signature_verify
from flows.services import flow_report_ingest

REPORT_HEADERS = (protocol.HEADER_WORKLOAD, protocol.HEADER_CREDENTIAL, protocol.HEADER_SIGNATURE)
access_log = logging.getLogger("palisade.access")


def report_sender_of(headers: Mapping[str, str]) -> ReportSender:
    """The report's sender, from its headers (a case-insensitive mapping) alone."""
    missing = [h for h in REPORT_HEADERS if not headers.get(h)]
    if missing:
        raise Problem("unauthenticated", f"A flow report carries the headers {', '.join(missing)}.")
    return report_sender_authenticate(
        workload_id=headers[protocol.HEADER_WORKLOAD], credential=headers[protocol.HEADER_CREDENTIAL]
    )


def report_sender_key(headers: Mapping[str, str]) -> tuple[str, str]:
    """What report_sender_of judges a sender by: the same workload and credential pass again."""
    return headers.get(protocol.HEADER_WORKLOAD, ""), headers.get(protocol.HEADER_CREDENTIAL, "")


def report_owner(headers: Mapping[str, str]) -> str | None:
    """Whose report it is, once report_sender_of passed its headers: the workload, in one spelling of its
    id (each spelling the UUID parser admits would otherwise be a body in flight of its own)."""
    key = workload_key(headers.get(protocol.HEADER_WORKLOAD, ""))
    return None if key is None else str(key)


class FlowReportView(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]
    headers_check = staticmethod(report_sender_of)
    headers_check_key = staticmethod(report_sender_key)
    body_owner = staticmethod(report_owner)

    def post(self, request):
        # Read from the stream: `request.body` holds bodies to the API's limit, and a report may be
        # larger (the middleware has checked its own limit).
        return Response(flow_report_take(request.headers, request._request.read))

    def finalize_response(self, request, response, *args, **kwargs):
        metrics.flow_report_answered(response)  # a refusal, by its problem type; stored ones count at commit
        return super().finalize_response(request, response, *args, **kwargs)


def flow_report_take(headers: Mapping[str, str], read: Callable[[], bytes]) -> dict:
    """A report's answer: its sender checked from the headers, then the body read (`read`) and its
    signature checked, then parsed and ingested. Raises the Problem that refuses it whole."""
    sender = report_sender_passed(headers)
    body = read()  # the signature covers these exact bytes
    report_signature_verify(sender=sender, signature=headers[protocol.HEADER_SIGNATURE], body=body)
    data = json_loads_strict(body, what="the flow report")
    return flow_report_ingest(workload_id=str(sender.workload_id), data=data, sender=sender)


def report_sender_passed(headers: Mapping[str, str]) -> ReportSender:
    """The sender as the body gate found it, while its pass holds (this process hears of every
    credential change: controlplane/body_gate.py), else checked now in the database. Either way the
    write checks the sender's credential again, under its workload's lock, in the transaction that
    stores the report (`flows.services`): a change made since refuses the report."""
    sender = passed_headers.passed_value(PassedHeaders.key(protocol.FLOWS_PATH, FlowReportView, headers))
    return sender if isinstance(sender, ReportSender) else report_sender_of(headers)


# serve's answer to a flow report without Django's handler, middleware and DRF: that machinery cost a
# fifth of serve's CPU per report, for a request whose every step is known. Only the plain case is
# taken (a POST on the gateway listener, without the headers a browser adds or a query, within the
# body limit): anything else goes the whole way, through `FlowReportView`, and is answered as before.
# The answer carries what the middleware and DRF add to the view's (tests/e2e compare the two).
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
        answer = flow_report_take(_Headers(environ), lambda: environ["wsgi.input"].read(int(length)))
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

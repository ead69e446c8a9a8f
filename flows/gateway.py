"""POST /agent/v1/flows on the gateway listener: an agent's signed flow report, answered per window
and gap. Refusals of the whole report (authentication, a malformed envelope) are problem documents.

serve checks a report's headers before it receives the body (`headers_check`, run by
controlplane/body_gate.py, which passes the same `headers_check_key` again for a few minutes without
asking, until the workload's credential changes): a sender that is not an enrolled workload with its
current credential is refused without its body being read, and a workload has one report body in flight
at a time (`body_owner`). The view always checks the headers again, with the body's signature."""

from __future__ import annotations

from collections.abc import Mapping

from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from agent import protocol
from controlplane import metrics
from controlplane.problems import Problem
from controlplane.strict_json import json_loads_strict
from fleet.credentials import workload_key
from fleet.report_auth import ReportSender, report_sender_authenticate, report_signature_verify
from flows.services import flow_report_ingest

REPORT_HEADERS = (protocol.HEADER_WORKLOAD, protocol.HEADER_CREDENTIAL, protocol.HEADER_SIGNATURE)


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
        sender = report_sender_of(request.headers)
        # The signature covers these exact bytes. Read from the stream: `request.body` holds bodies to
        # the API's limit, and a report may be larger (the middleware has checked its own limit).
        body = request._request.read()
        report_signature_verify(
            sender=sender, signature=request.headers[protocol.HEADER_SIGNATURE], body=body
        )
        data = json_loads_strict(body, what="the flow report")
        return Response(flow_report_ingest(workload_id=str(sender.workload_id), data=data))

    def finalize_response(self, request, response, *args, **kwargs):
        metrics.flow_report_answered(response)  # a refusal, by its problem type; stored ones count at commit
        return super().finalize_response(request, response, *args, **kwargs)

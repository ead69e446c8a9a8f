"""POST /agent/v1/flows on the gateway listener: an agent's signed flow report, answered per window
and gap. Refusals of the whole report (authentication, a malformed envelope) are problem documents.

serve checks a report's headers before it receives the body (`headers_check`, run by
controlplane/body_gate.py, which passes the same `headers_check_key` again for a few minutes without
asking, until the workload's credential changes): a sender that is not an enrolled workload with its
current credential is refused without its body being read, and a workload has one report body in flight
at a time (`body_owner`). The report's answer (`flow_report_take`) takes the sender as the gate found it
while that pass holds (serve's own answer, controlplane/gateway_reports.py), else checks the headers in
the database (this view), then checks the body's signature; the write checks the sender's credential
once more, under its workload's lock (a revocation made meanwhile refuses the report)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

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
        # Read from the stream: `request.body` holds bodies to the API's limit, and a report may be
        # larger (the middleware has checked its own limit).
        return Response(flow_report_take(request.headers, request._request.read))

    def finalize_response(self, request, response, *args, **kwargs):
        metrics.flow_report_answered(response)  # a refusal, by its problem type; stored ones count at commit
        return super().finalize_response(request, response, *args, **kwargs)


def flow_report_take(
    headers: Mapping[str, str], read: Callable[[], bytes], *, sender: ReportSender | None = None
) -> dict:
    """A report's answer: its sender (`sender`, as the body gate found it, else checked now from the
    headers), then the body read (`read`) and its signature checked, then parsed and ingested. Raises
    the Problem that refuses it whole."""
    if sender is None:
        sender = report_sender_of(headers)
    body = read()  # the signature covers these exact bytes
    report_signature_verify(sender=sender, signature=headers[protocol.HEADER_SIGNATURE], body=body)
    data = json_loads_strict(body, what="the flow report")
    return flow_report_ingest(workload_id=str(sender.workload_id), data=data, sender=sender)

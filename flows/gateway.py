"""POST /agent/v1/flows on the gateway listener: an agent's signed flow report, answered per window
and gap. Refusals of the whole report (authentication, a malformed envelope) are problem documents."""

from __future__ import annotations

from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from agent import protocol
from controlplane.problems import Problem
from controlplane.strict_json import json_loads_strict
from fleet.streams import report_authenticate
from flows.services import flow_report_ingest


class FlowReportView(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]

    def post(self, request):
        # The signature covers these exact bytes. Read from the stream: `request.body` holds bodies to
        # the API's limit, and a report may be larger (the middleware has checked its own limit).
        body = request._request.read()
        headers = request.headers
        missing = [
            h
            for h in (protocol.HEADER_WORKLOAD, protocol.HEADER_CREDENTIAL, protocol.HEADER_SIGNATURE)
            if not headers.get(h)
        ]
        if missing:
            raise Problem("unauthenticated", f"A flow report carries the headers {', '.join(missing)}.")
        workload_id = report_authenticate(
            workload_id=headers[protocol.HEADER_WORKLOAD],
            credential=headers[protocol.HEADER_CREDENTIAL],
            signature=headers[protocol.HEADER_SIGNATURE],
            body=body,
        )
        data = json_loads_strict(body, what="the flow report")
        return Response(flow_report_ingest(workload_id=str(workload_id), data=data))

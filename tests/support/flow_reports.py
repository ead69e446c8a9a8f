"""An enrolled agent's signed flow report, posted to the real serve's gateway as the agent posts it."""

from __future__ import annotations

import httpx

from agent.flowreport import report_headers
from agent.protocol import FLOWS_PATH


def post_flow_report(
    serve, enrolment, body: bytes, *, sent: bytes | None = None, **headers
) -> httpx.Response:
    """Sign `body` with the agent's key and credential; send `sent` instead when given (a body tampered
    with after signing), with any header replaced by `headers`."""
    signed = report_headers(
        body,
        key=enrolment.key,
        workload_id=enrolment.identity.workload_id,
        credential=enrolment.credential,
        gateway_fingerprint=enrolment.identity.fingerprint,
    )
    with serve.client("gateway") as gateway:
        return gateway.post(FLOWS_PATH, content=body if sent is None else sent, headers={**signed, **headers})

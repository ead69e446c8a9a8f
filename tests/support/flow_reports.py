"""An enrolled agent's signed flow report, posted to the real serve's gateway as the agent posts it."""

from __future__ import annotations

import httpx

from agent.protocol import FLOWS_PATH


def post_flow_report(
    serve, enrolment, body: bytes, *, sent: bytes | None = None, **headers
) -> httpx.Response:
    """Sign `body` with the agent's key and credential; send `sent` instead when given (a body tampered
    with after signing), with any header replaced by `headers`."""
    signed = enrolment.flow_report_headers(body)
    with serve.client("gateway") as gateway:
        return gateway.post(FLOWS_PATH, content=body if sent is None else sent, headers={**signed, **headers})

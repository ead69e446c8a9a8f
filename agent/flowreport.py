"""A flow report's body and headers, from what the buffer holds (agent/flowbuffer.py).

Instants travel as RFC 3339 text; the body is signed (agent/protocol.py, `sign_flow_report`) so the
gateway can tell the report came from this workload's key, with its current credential.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent import protocol


def instant(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _window(record: dict[str, Any]) -> dict[str, Any]:
    groups = [
        {**group, "first_seen": instant(group["first_seen"]), "last_seen": instant(group["last_seen"])}
        for group in record["groups"]
    ]
    return {**record, "start": instant(record["start"]), "end": instant(record["end"]), "groups": groups}


def _gap(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "start": instant(record["start"]), "end": instant(record["end"])}


def report_body(
    windows: list[dict[str, Any]],
    gaps: list[dict[str, Any]],
    *,
    now: float,
    process_start_id: str,
    uptime_seconds: float,
    window_seconds: int,
) -> bytes:
    report = protocol.flow_report(
        agent_clock=instant(now),
        process_start_id=process_start_id,
        uptime_seconds=round(uptime_seconds, 3),
        window_seconds=window_seconds,
        windows=[_window(w) for w in windows],
        gaps=[_gap(g) for g in gaps],
    )
    return json.dumps(report, separators=(",", ":")).encode()


def report_headers(
    body: bytes, *, key: Ed25519PrivateKey, workload_id: str, credential: str, gateway_fingerprint: str
) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        protocol.HEADER_WORKLOAD: workload_id,
        protocol.HEADER_CREDENTIAL: credential,
        protocol.HEADER_SIGNATURE: protocol.sign_flow_report(
            key, body=body, workload_id=workload_id, gateway_fingerprint=gateway_fingerprint
        ),
    }

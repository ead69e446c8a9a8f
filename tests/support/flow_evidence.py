"""Flow evidence for tests that call the domain functions directly: an enrolled workload with its key,
the golden flow report, and reports of back-to-back one-minute windows."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.credential import public_key_encode
from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from fleet.enrolment import workload_enrol
from fleet.provisioning import provisioning_token_mint

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "flows" / "flow_report.json"


def enrolled(hostname="web", address="10.50.0.1"):
    key = Ed25519PrivateKey.generate()
    secret = provisioning_token_mint(actor=CLI_ACTOR, data={"description": "flows"}).secret
    done = workload_enrol(
        token_secret=secret,
        public_key=public_key_encode(key.public_key()),
        hostname=hostname,
        addresses=[address],
        agent_version="0.1.0",
    )
    return done.workload, key, done.credential.text


def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def at_agent_clock(report: dict, now: datetime) -> dict:
    return {**report, "agent_clock": now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}


def flow_report(process: str, uptime: float, windows=()) -> dict:
    return at_agent_clock(
        {
            **golden(),
            "process_start_id": process,
            "uptime_seconds": uptime,
            "windows": list(windows),
            "gaps": [],
        },
        clock.now(),
    )


def windows_between(start: datetime, minutes: int) -> list[dict]:
    """Back-to-back one-minute windows from `start` (aligned), each with one connection."""
    start = start.replace(second=0, microsecond=0) + timedelta(minutes=1)
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # noqa: E731
    return [
        {
            "id": str(uuid.uuid4()),
            "start": text(start + timedelta(minutes=i)),
            "end": text(start + timedelta(minutes=i + 1)),
            "policy_version": "v",
            "accounting": False,
            "groups": [
                {"peer": "10.9.9.9", "protocol": "tcp", "port": 22, "decision": "observed", "rule": None,
                 "connection_count": 1, "first_seen": text(start + timedelta(minutes=i, seconds=1)),
                 "last_seen": text(start + timedelta(minutes=i, seconds=1)), "bytes_in": 0, "bytes_out": 0}
            ],
        }
        for i in range(minutes)
    ]  # fmt: skip

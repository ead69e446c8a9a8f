"""The JSON shapes of stored flow evidence."""

from __future__ import annotations

from typing import Any

from controlplane.clock import rfc3339
from flows.models import EvidenceGap, FlowWindow


def flow_window_data(window: FlowWindow, rule_ids: dict[int, str]) -> dict[str, Any]:
    return {
        "id": str(window.id),
        "workload_id": str(window.workload_id),
        "start": rfc3339(window.start),
        "end": rfc3339(window.end),
        "policy_version": window.policy_version or None,
        "accounting": window.accounting,
        "received_at": rfc3339(window.received_at),
        "groups": [
            {
                "peer": group.peer,
                "peer_workload_id": str(group.peer_workload_id) if group.peer_workload_id else None,
                "protocol": group.protocol,
                "port": group.port,
                "decision": group.decision,
                "rule_number": group.rule_number,
                "rule_id": rule_ids.get(group.rule_number) if group.rule_number else None,
                "connection_count": group.connection_count,
                "first_seen": rfc3339(group.first_seen),
                "last_seen": rfc3339(group.last_seen),
                "bytes_in": group.bytes_in,
                "bytes_out": group.bytes_out,
            }
            for group in window.groups.all()
        ],
    }


def evidence_gap_data(gap: EvidenceGap) -> dict[str, Any]:
    return {
        "id": str(gap.id),
        "workload_id": str(gap.workload_id),
        "kind": gap.kind,
        "source": gap.source,
        "start": rfc3339(gap.start),
        "end": rfc3339(gap.end),
        "lost": gap.lost,
    }

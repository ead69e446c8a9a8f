"""The JSON shapes of stored flow evidence."""

from __future__ import annotations

from typing import Any

from controlplane.clock import rfc3339
from flows.models import EvidenceGap, FlowWindow


def flow_window_data(
    window: FlowWindow, rule_ids: dict[int, str], *, directions: bool = False
) -> dict[str, Any]:
    """A window and its groups; with `directions` (a read of outbound or both), each group says its
    direction and fail-safe marker (an inbound read's groups are all inbound: shown as they always were)."""
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
                **({"direction": group.direction, "failsafe": group.failsafe} if directions else {}),
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


def rollup_row_data(row: dict[str, Any], rule_ids: dict[int, str]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    if "workload_id" in row:
        data["workload_id"] = str(row["workload_id"])
    if "peer" in row:
        data["peer"] = row["peer"]
    if "peer_workload_id" in row:
        data["peer_workload_id"] = str(row["peer_workload_id"]) if row["peer_workload_id"] else None
    if "protocol" in row:
        data["service"] = {"protocol": row["protocol"], "port": row["port"]}
    if "decision" in row:
        data["decision"] = row["decision"]
    if "direction" in row:
        data["direction"] = row["direction"]
    if "rule_number" in row:
        data["rule_number"] = row["rule_number"]
        data["rule_id"] = rule_ids.get(row["rule_number"]) if row["rule_number"] else None
        data["rule_action"] = row.get("rule_action")
    if "start" in row:
        data["window_start"] = rfc3339(row["start"])
    if "ruleset_id" in row:
        data["ruleset_id"] = str(row["ruleset_id"]) if row["ruleset_id"] else None
    data.update(
        connection_count=row["connection_count"],
        bytes_in=row["bytes_in"],
        bytes_out=row["bytes_out"],
        first_seen=rfc3339(row["first_seen"]),
        last_seen=rfc3339(row["last_seen"]),
    )
    return data


def coverage_data(coverage: dict[str, Any]) -> dict[str, Any]:
    return {
        **coverage,
        "gaps": [evidence_gap_data(gap) for gap in coverage["gaps"]],
        "retained_from": rfc3339(coverage["retained_from"]),
        **{
            listed: [
                {
                    "workload_id": str(w["workload_id"]),
                    "hostname": w["hostname"],
                    "since": rfc3339(w["since"]),
                }
                for w in coverage[listed]
            ]
            for listed in ("silent_workloads", "pending_workloads")
        },
    }


def rule_data_brief(rule) -> dict[str, Any]:
    return {
        "rule_id": str(rule.id),
        "rule_number": rule.number,
        "ruleset_id": str(rule.ruleset_id),
        "ruleset_name": rule.ruleset.name,
        "action": rule.action,
    }


def review_data(review: dict[str, Any]) -> dict[str, Any]:
    return {
        "verdict": review["verdict"],
        "reasons": review["reasons"],
        "workload_count": review["workload_count"],
        "would_block_count": review["would_block_count"],
        "would_block": [
            {
                "workload_id": str(row["workload_id"]),
                "peer": row["peer"],
                "service": {"protocol": row["protocol"], "port": row["port"]},
                **({"direction": row["direction"]} if "direction" in row else {}),
                "connection_count": row["connection_count"],
                # The deny rule that refused them; null: no rule admits them.
                "rule_number": row["rule_number"],
                "rule_id": review["rule_ids"].get(row["rule_number"]) if row["rule_number"] else None,
                "rule_action": row.get("rule_action"),
            }
            for row in review["would_block"]
        ],
        "coverage": coverage_data(review["coverage"]),
        "offline_count": review["offline_count"],
        "offline": [
            {"workload_id": str(w.id), "hostname": w.hostname, "last_heard_from": rfc3339(w.last_heard_from)}
            for w in review["offline"]
        ],
        "decided_outside_simulation": [
            {
                "workload_id": str(row["workload_id"]),
                "decision": row["decision"],
                "connection_count": row["connection_count"],
            }
            for row in review["decided_outside_simulation"]
        ],
        "not_in_simulation_count": review["not_in_simulation_count"],
        "not_in_simulation": [
            {
                "workload_id": str(w.id),
                "hostname": w.hostname,
                "mode": w.mode,
                "mode_since": rfc3339(w.mode_since or w.enrolled_at),
                # An outbound review's workloads say their outbound mode too; an inbound one's as before.
                **(
                    {
                        "outbound_mode": w.outbound_mode,
                        "outbound_mode_since": rfc3339(w.outbound_mode_since or w.enrolled_at),
                    }
                    if review.get("direction", "inbound") != "inbound"
                    else {}
                ),
            }
            for w in review["not_in_simulation"]
        ],
    }


def rollup_data(
    rows: list[dict[str, Any]],
    *,
    rule_ids: dict[int, str],
    next_cursor: str | None,
    coverage: dict[str, Any],
    unused_rules,
) -> dict[str, Any]:
    """GET /flows/rollup's document (and `manage.py flows rollup --json`'s): `coverage` as
    `coverage_data` gives it, `unused_rules` a list of rules or None."""
    return {
        "items": [rollup_row_data(row, rule_ids) for row in rows],
        "next_cursor": next_cursor,
        "coverage": coverage,
        "unused_rules": None if unused_rules is None else [rule_data_brief(rule) for rule in unused_rules],
    }


def keys_read_data(read) -> dict[str, Any]:
    """What a read of draft policy (impact, suggestions) says of the flow keys it read
    (flows.selectors.flow_keys_summed): how many keys the range holds, and how many of them (and of their
    connections) were left out past the bound: the answer is incomplete when any was."""
    return {
        "keys_total": read.key_count,
        "keys_left_out": read.key_count - len(read.rows),
        "connections_left_out": read.connections_left_out,
    }

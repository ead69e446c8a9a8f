"""The JSON shape of workloads and fleet reads, shared by the API and the command line."""

from __future__ import annotations

from controlplane import clock
from controlplane.clock import rfc3339
from controlplane.conditional import version_text
from fleet import health as flow_health
from fleet.choices import SyncState
from fleet.credentials import credential_renewal_due_at, credential_state
from fleet.models import ModeChange, RenderedPolicy, Workload
from fleet.selectors import mode_change_workloads, workload_flow_window


def telemetry_live(workload: Workload, now) -> bool:
    """A report arrived within two of the workload's own flow windows."""
    return flow_health.telemetry_live(
        last_report_at=workload.last_flow_report_at,
        window=workload_flow_window(seconds=workload.flow_window_seconds),
        now=now,
    )


def workload_data(workload: Workload) -> dict:
    now = clock.now()
    latest = workload.latest_policy_id or None
    state = workload.sync_state
    return {
        "id": str(workload.id),
        "hostname": workload.hostname,
        "addresses": list(workload.addresses),
        "labels": dict(workload.labels),
        "labels_version": version_text(workload.labels_version),
        "mode": workload.mode,
        "mode_since": rfc3339(workload.mode_since or workload.enrolled_at),
        "outbound_mode": workload.outbound_mode,
        "outbound_mode_since": rfc3339(workload.outbound_mode_since or workload.enrolled_at),
        "latest_version": latest,
        "applied_version": workload.applied_version or None,
        "agent_version": workload.agent_version or None,
        "sync": {
            "state": state,
            "last_snapshot_sent_at": rfc3339(workload.last_snapshot_sent_at),
            "last_heard_from": rfc3339(workload.last_heard_from),
            "never_connected": workload.last_heard_from is None,
            "gateway": (workload.stream_gateway or None) if workload.stream_id else None,
            "error": workload.sync_error if state == SyncState.DEGRADED else None,
            "pending_version": latest if state == SyncState.PENDING else None,
        },
        "health": {
            "telemetry_live": telemetry_live(workload, now),
            "clock_skew": (
                {
                    "offset_seconds": workload.clock_skew_seconds,
                    "seen_at": rfc3339(workload.clock_skew_seen_at),
                }
                if workload.clock_skew_seconds is not None
                else None
            ),
            "evidence_gap": (
                {
                    "kind": workload.last_gap_kind,
                    "start": rfc3339(workload.last_gap_start),
                    "end": rfc3339(workload.last_gap_end),
                }
                if workload.last_gap_end is not None
                else None
            ),
            "owned_table": {
                "state": workload.owned_table_state,
                "modified_at": rfc3339(workload.table_modified_at),
                "restored_at": rfc3339(workload.table_restored_at),
                "modification": workload.table_modification or None,
            },
            "credential": {
                "state": credential_state(workload, now),
                "expires_at": rfc3339(workload.credential_expires_at),
                "renewal_due_at": rfc3339(credential_renewal_due_at(workload)),
                "last_error": workload.credential_last_error or None,
                "last_late_renewal": rfc3339(workload.credential_last_late_renewal),
                "last_late_renewal_late_by_seconds": workload.credential_last_late_by_seconds,
                "revoked": (
                    {
                        "at": rfc3339(workload.credential_revoked_at),
                        "reason": workload.credential_revoked_reason or None,
                    }
                    if workload.credential_revoked_at is not None
                    else None
                ),
            },
        },
        "enrolled_at": rfc3339(workload.enrolled_at),
    }


def labels_data(workload: Workload) -> dict:
    return {"labels": dict(workload.labels), "version": version_text(workload.labels_version)}


def rendered_policy_data(workload: Workload, policy: RenderedPolicy | None) -> dict:
    return {
        "workload_id": str(workload.id),
        "mode": workload.mode,
        "outbound_mode": workload.outbound_mode,
        "version": policy.version if policy else None,
        "rendered_at": rfc3339(policy.created_at) if policy else None,
        "document": policy.document if policy else None,
        "rule_index": policy.rule_index if policy else {},
    }


def _confirmation_state(intent: ModeChange) -> str | None:
    if intent.confirm_by is None:
        return None
    if intent.confirmed_at is not None:
        return "confirmed"
    return "reverted" if intent.reverted_at is not None else "awaiting"


def mode_change_data(intent: ModeChange) -> dict:
    revert = getattr(intent, "revert", None) if intent.reverted_at is not None else None
    return {
        "id": str(intent.id),
        "mode": intent.mode,
        "direction": intent.direction,
        "selection": intent.selection,
        "resolved_count": intent.resolved_count,
        "changed_count": intent.changed_count,
        "actor": intent.actor,
        "created_at": rfc3339(intent.created_at),
        "confirm_by": rfc3339(intent.confirm_by),
        "confirmation": _confirmation_state(intent),
        "confirmed_at": rfc3339(intent.confirmed_at),
        "confirmed_by": intent.confirmed_by or None,
        "reverted_at": rfc3339(intent.reverted_at),
        "reverted_by": str(revert.id) if revert is not None else None,
        "reverts": str(intent.reverts_id) if intent.reverts_id else None,
        "reason": intent.reason or None,
    }


def mode_change_detail_data(intent: ModeChange) -> dict:
    """One mode change with its workloads: for a change with a deadline, the mode each would go back
    to; for a revert, the mode each went back to, and the ones it left alone."""
    return {
        **mode_change_data(intent),
        "workloads": [
            {"workload_id": workload_id, "mode_before": before, "mode_after": after}
            for workload_id, before, after in mode_change_workloads(change=intent)
        ],
        "left_alone": intent.left_alone,
    }

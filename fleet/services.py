"""Operator writes on the fleet: label edits, mode changes and resend-snapshot."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.db import transaction

from controlplane import clock
from controlplane.audit import audit_record
from controlplane.auth.actor import Actor
from controlplane.conditional import check_version
from controlplane.problems import Finding, Problem, ValidationFailed, pointer
from controlplane.validation import Findings, quoted, reject_unknown, require_object, take_int
from controlplane.webhooks.outbox import webhook_event_record
from fleet.choices import Mode, SyncState
from fleet.mode_confirmations import (
    CONFIRM_WITHIN_MAX,
    CONFIRM_WITHIN_MIN,
    mode_change_holds_record,
    mode_fields,
)
from fleet.models import ModeChange, Workload
from fleet.push import notify_streams
from fleet.rendering import rerender_for_peer_change, workloads_rerender
from fleet.selectors import MAX_ID_FILTERS, workload_get
from policy.choices import Direction
from policy.grammar import GrammarError, parse_selector, validate_labels

MAX_LABELS = 64
MAX_SELECTION_IDS = MAX_ID_FILTERS


def labels_input(data: Any) -> dict[str, str]:
    data = require_object(data)
    findings = Findings()
    reject_unknown(data, {"labels", "version"}, findings)
    labels = data.get("labels")
    if "labels" not in data:
        findings.add("/labels", "required", "labels is required (an object of key: value).")
    else:
        for key, error in validate_labels(labels):
            findings.add("/labels" + (pointer(key) if key else ""), error.rule, error.message)
        if isinstance(labels, dict) and len(labels) > MAX_LABELS:
            findings.add("/labels", "too-many", f"A workload may have at most {MAX_LABELS} labels.")
    findings.raise_if_any()
    return dict(labels)


def workload_labels_replace(
    *, actor: Actor, workload_id: str, expected_version: str, data: Mapping[str, Any]
) -> Workload:
    """Replace a workload's labels; re-render it and the workloads whose peers it is or was."""
    with transaction.atomic():
        workload = workload_get(workload_id=workload_id, for_update=True)
        labels = labels_input(data)
        check_version(current=workload.labels_version, expected=expected_version, what="label set")
        before = dict(workload.labels)
        workload.labels = labels
        workload.labels_version += 1
        workload.save(update_fields=["labels", "labels_version"])
        audit_record(
            actor=actor,
            action="workload.labels_replace",
            object_type="workload",
            object_id=workload.id,
            object_name=workload.hostname,
            version_before=workload.labels_version - 1,
            version_after=workload.labels_version,
            detail={"labels_before": before, "labels": labels},
        )
        if before != labels:
            rerender_for_peer_change(workload_id=str(workload.id), labels_before=before)
    return workload


def _selection_input(data: Any, findings: Findings) -> dict:
    if not isinstance(data, dict):
        findings.add(
            "/selection",
            "type",
            'selection must be an object: {"labels": [...], "workload_ids": [...]} or {"all": true}.',
        )
        return {}
    reject_unknown(data, {"labels", "workload_ids", "all"}, findings, "/selection")
    selection: dict = {}
    if data.get("all") is True:
        if set(data) - {"all"}:
            findings.add("/selection/all", "selection-all", "all selects every workload; give it alone.")
        selection["all"] = True
    elif "all" in data:
        findings.add("/selection/all", "type", "all must be true when given.")
    labels = data.get("labels", [])
    if not isinstance(labels, list) or len(labels) > 64:
        findings.add("/selection/labels", "type", "labels must be a list of at most 64 label requirements.")
        labels = []
    requirements = []
    for index, text in enumerate(labels):
        try:
            requirements.append(str(parse_selector(text)))
        except GrammarError as error:
            findings.add(pointer("selection", "labels", index), error.rule, error.message)
    if requirements:
        selection["labels"] = requirements
    ids = data.get("workload_ids", [])
    if not isinstance(ids, list) or len(ids) > MAX_SELECTION_IDS:
        findings.add(
            "/selection/workload_ids",
            "type",
            f"workload_ids must be a list of at most {MAX_SELECTION_IDS} ids.",
        )
        ids = []
    parsed_ids = []
    for index, text in enumerate(ids):
        try:
            parsed_ids.append(str(uuid.UUID(str(text))))
        except ValueError:
            findings.add(
                pointer("selection", "workload_ids", index), "type", f"{quoted(text)} is not a workload id."
            )
    if parsed_ids:
        selection["workload_ids"] = sorted(set(parsed_ids))
    if not selection and not findings:
        findings.add(
            "/selection",
            "empty-selection",
            'Select workloads by labels and/or workload_ids, or {"all": true}.',
        )
    return selection


def mode_change_input(data: Any) -> tuple[dict, str, int | None, str]:
    """The selection, the mode, the seconds within which the change must be confirmed (None: it
    need not be) and the direction whose mode it moves (inbound unless given)."""
    data = require_object(data)
    findings = Findings()
    reject_unknown(data, {"selection", "mode", "confirm_within_seconds", "direction"}, findings)
    direction = data.get("direction", Direction.INBOUND)
    if direction not in Direction.values:
        findings.add("/direction", "direction", f"direction must be one of {', '.join(Direction.values)}.")
    if "selection" not in data:
        findings.add("/selection", "required", "selection is required.")
        selection = {}
    else:
        selection = _selection_input(data["selection"], findings)
    mode = data.get("mode")
    if mode not in Mode.values:
        findings.add(
            "/mode",
            "mode" if "mode" in data else "required",
            f"mode must be one of {', '.join(Mode.values)}.",
        )
    confirm_within = take_int(
        data, "confirm_within_seconds", findings, minimum=CONFIRM_WITHIN_MIN, maximum=CONFIRM_WITHIN_MAX
    )
    findings.raise_if_any()
    return selection, mode, confirm_within, direction


def selection_resolve(selection: dict) -> list[str]:
    """The workload ids a selection resolves to now: label requirements ANDed, and, when ids are
    given, only those ids (both narrow the selection)."""
    queryset = Workload.objects.all()
    if "workload_ids" in selection:
        queryset = queryset.filter(id__in=selection["workload_ids"])
    rows = queryset.values_list("id", "labels")
    requirements = [parse_selector(text) for text in selection.get("labels", [])]
    return [str(wid) for wid, labels in rows if all(r.matches(labels) for r in requirements)]


def mode_change_create(*, actor: Actor, data: Mapping[str, Any]) -> ModeChange:
    """Record the intent, move the selected workloads' mode and render their documents. Convergence
    (applied == latest) is observed on the workloads, not awaited here. With `confirm_within_seconds`
    the change must be confirmed by then, or the system puts it back (fleet/mode_confirmations.py)."""
    selection, mode, confirm_within, direction = mode_change_input(data)
    fields = mode_fields(direction)
    with transaction.atomic():
        ids = selection_resolve(selection)
        if not ids:
            raise ValidationFailed(
                [Finding("/selection", "selects-nothing", "The selection matches no workload.")]
            )
        # Every selected workload is locked, in one order (two changes never wait on each other in
        # a circle): this change takes each one over from whichever change selected it before.
        selected = list(
            Workload.objects.select_for_update()
            .filter(id__in=ids)
            .order_by("id")
            .values_list("id", fields.mode, fields.holder)
        )
        changed = [workload_id for workload_id, current, _ in selected if current != mode]
        now = clock.now()
        intent = ModeChange.objects.create(
            actor=str(actor),
            created_at=now,
            selection=selection,
            mode=mode,
            resolved_count=len(ids),
            changed_count=len(changed),
            confirm_by=now + timedelta(seconds=confirm_within) if confirm_within else None,
            direction=direction,
        )
        if intent.confirm_by is not None:
            mode_change_holds_record(change=intent, selected=selected)
        Workload.objects.filter(id__in=changed).update(
            **{fields.mode: mode, fields.since: now, fields.holder: intent}
        )
        unchanged = [workload_id for workload_id, current, _ in selected if current == mode]
        Workload.objects.filter(id__in=unchanged).update(**{fields.holder: intent})
        workloads_rerender(workload_ids=[str(i) for i in changed])
        audit_record(
            actor=actor,
            action="mode_change.create",
            object_type="mode_change",
            object_id=intent.id,
            detail={
                "selection": selection,
                "mode": mode,
                "direction": direction,
                "resolved_count": len(ids),
                "changed_workload_ids": sorted(str(i) for i in changed),
                **({"confirm_by": clock.rfc3339(intent.confirm_by)} if intent.confirm_by else {}),
            },
        )
        webhook_event_record("mode_change.requested", _mode_change_event_data(intent, actor, changed))
    return intent


def _mode_change_event_data(intent: ModeChange, actor: Actor, changed: list) -> dict:
    return {
        "mode_change": {
            "id": str(intent.id),
            "mode": intent.mode,
            "direction": intent.direction,
            "selection": intent.selection,
            "resolved_count": intent.resolved_count,
            "changed_workload_ids": sorted(str(i) for i in changed),
            "confirm_by": clock.rfc3339(intent.confirm_by),
        },
        "actor": actor.label,
    }


def workload_resend_snapshot(*, actor: Actor, workload_id: str) -> Workload:
    """Direct the workload's agent to reconnect and receive a fresh snapshot; the confirmation is
    `sync.last_snapshot_sent_at` moving past the request."""
    with transaction.atomic():
        workload = workload_get(workload_id=workload_id, for_update=True)
        if workload.sync_state == SyncState.OFFLINE:
            heard = workload.last_heard_from
            when = f"last heard from at {clock.rfc3339(heard)}" if heard else "it has never connected"
            raise Problem(
                "workload-offline",
                f"Workload {workload.hostname} is offline ({when}); it gets a fresh snapshot when it reconnects.",
                last_heard_from=clock.rfc3339(heard),
            )
        # Recorded as well as sent: serve's catch-up sweep repeats the directive until a snapshot
        # answers it, so a resend from a host command reaches a serve process without Redis.
        workload.resend_requested_at = clock.now()
        workload.save(update_fields=["resend_requested_at"])
        audit_record(
            actor=actor,
            action="workload.resend_snapshot",
            object_type="workload",
            object_id=workload.id,
            object_name=workload.hostname,
        )
        notify_streams([str(workload.id)], {"type": "resend.snapshot"})
    return workload

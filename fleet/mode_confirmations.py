"""Mode changes that need confirming: a change made with a deadline (`confirm_by`) is put back by the
system unless it is confirmed in time, as network operators' "commit confirmed" is. An enforcing change
that cuts the operator off from a workload undoes itself.

- At creation (`mode_change_holds_record`, called by `fleet.services.mode_change_create`) the change
  records, per workload, the mode it had before and the mode the change set (`ModeChangeWorkload`).
  "Before" is the workload's mode, unless an earlier change still awaiting confirmation held it: then
  it is the mode that change would put back, so a chain of unconfirmed changes goes back to where it
  started rather than to the middle of the chain.
- Every mode change that selects a workload takes it over (`Workload.mode_change`), whether or not
  its mode moved: the operator's latest word on a workload stands, and an earlier deadline no longer
  reverts it.
- `mode_change_confirm`: confirmed up to and including the deadline; again is harmless.
- `mode_changes_revert_due` (serve's housekeeping, every second): each change whose deadline passed
  unconfirmed is reverted once. The workloads it still holds, in the mode it set, go back to the mode
  they had before, as a new intent of the system (audited, webhook `mode_change.reverted`); the ones
  another change took over since are left as they are and listed. Each change is reverted in a
  transaction of its own with its row locked and its state read again under the lock (PostgreSQL:
  SKIP LOCKED, so several serve processes share the work and none waits on another), and the
  database holds at most one revert per change: exactly once, whichever process gets there first.

The records name the mode field they apply to by nothing but their columns: a change of another kind
of mode would add which field it moves, not another way to put it back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction

from controlplane import clock
from controlplane.audit import audit_record
from controlplane.auth.actor import SYSTEM_ACTOR, Actor
from controlplane.lookups import get_or_not_found
from controlplane.problems import Problem
from controlplane.webhooks.outbox import webhook_event_record
from fleet.models import ModeChange, ModeChangeWorkload, Workload
from fleet.rendering import workloads_rerender

log = logging.getLogger("palisade.fleet")

CONFIRM_WITHIN_MIN = 10
CONFIRM_WITHIN_MAX = 86_400


@dataclass(frozen=True)
class ModeFields:
    """The workload's columns of one direction's mode: the mode, since when, the change holding it."""

    mode: str
    since: str
    holder: str


_MODE_FIELDS = {
    "inbound": ModeFields("mode", "mode_since", "mode_change"),
    "outbound": ModeFields("outbound_mode", "outbound_mode_since", "outbound_mode_change"),
}


def mode_fields(direction: str) -> ModeFields:
    return _MODE_FIELDS[direction]


def _awaiting(changes):
    return changes.filter(confirm_by__isnull=False, confirmed_at__isnull=True, reverted_at__isnull=True)


def mode_change_holds_record(*, change: ModeChange, selected: Iterable[tuple]) -> None:
    """For a change with a deadline: what its revert would put back, per selected workload whose mode
    it moves away from that (`selected`: (workload id, mode, the change holding it), read locked, before
    the change moves them). Call in the change's transaction."""
    selected = list(selected)
    holders = {holder for _, _, holder in selected if holder is not None}
    awaiting = set(_awaiting(ModeChange.objects.filter(id__in=holders)).values_list("id", flat=True))
    earlier = {
        (holder, workload_id): before
        for holder, workload_id, before in ModeChangeWorkload.objects.filter(
            mode_change_id__in=awaiting,
            workload_id__in=[w for w, _, holder in selected if holder in awaiting],
        ).values_list("mode_change_id", "workload_id", "mode_before")
    }
    rows = []
    for workload_id, mode, holder in selected:
        before = earlier.get((holder, workload_id), mode)
        if before != change.mode:
            rows.append(
                ModeChangeWorkload(
                    mode_change=change,
                    workload_id=workload_id,
                    mode_before=before,
                    mode_after=change.mode,
                    direction=change.direction,
                )
            )
    ModeChangeWorkload.objects.bulk_create(rows, batch_size=2000)


def mode_change_confirm(*, actor: Actor, mode_change_id) -> ModeChange:
    """Confirm a change before its deadline passes (at the deadline itself still counts). Confirming a
    confirmed change returns it as it is; a change without a deadline, or one whose deadline passed,
    is a problem, so that a script confirming the wrong id learns it did not confirm the right one."""
    with transaction.atomic():
        change = get_or_not_found(ModeChange, mode_change_id, what="mode change", for_update=True)
        if change.confirm_by is None:
            made = "the system's revert of another change" if change.reverts_id else "made"
            raise Problem(
                "no-confirmation-deadline",
                f"Mode change {change.id} has nothing to confirm: it was {made} without "
                "confirm_within_seconds, and stands as it is.",
            )
        if change.confirmed_at is not None:
            return change
        if change.reverted_at is not None or clock.now() > change.confirm_by:
            revert = ModeChange.objects.filter(reverts=change).values_list("id", flat=True).first()
            done = f"it was put back by mode change {revert}" if revert else "it is being put back"
            raise Problem(
                "confirmation-deadline-passed",
                f"Mode change {change.id} was not confirmed by {clock.rfc3339(change.confirm_by)}: {done}.",
                confirm_by=clock.rfc3339(change.confirm_by),
                reverted_by=str(revert) if revert else None,
            )
        change.confirmed_at = clock.now()
        change.confirmed_by = actor.label[:300]
        change.save(update_fields=["confirmed_at", "confirmed_by"])
        audit_record(
            actor=actor,
            action="mode_change.confirm",
            object_type="mode_change",
            object_id=change.id,
            detail={"confirm_by": clock.rfc3339(change.confirm_by)},
        )
    return change


def mode_changes_revert_due(*, now: datetime | None = None) -> int:
    """Revert every change whose deadline passed unconfirmed before `now`; how many were reverted."""
    now = now or clock.now()
    reverted = 0
    while _revert_next_due(now=now) is not None:
        reverted += 1
    return reverted


def _revert_next_due(*, now: datetime) -> ModeChange | None:
    with transaction.atomic():
        due = _awaiting(ModeChange.objects.filter(confirm_by__lt=now)).order_by("confirm_by", "id")
        if connection.features.has_select_for_update_skip_locked:
            # Another serve process reverting a change holds its row: this one takes the next.
            due = due.select_for_update(skip_locked=True)
        change = due.first()
        return None if change is None else _revert(change, now=clock.now())


def _revert(change: ModeChange, *, now: datetime) -> ModeChange:
    """Put back the workloads `change` still holds in the mode it set; list the others."""
    held = list(
        ModeChangeWorkload.objects.filter(mode_change=change)
        .order_by("workload_id")
        .values_list("workload_id", "mode_before", "mode_after")
    )
    fields = mode_fields(change.direction)
    current = {
        workload_id: (mode, holder)
        for workload_id, mode, holder in Workload.objects.select_for_update()
        .filter(id__in=[workload_id for workload_id, _, _ in held])
        .order_by("id")
        .values_list("id", fields.mode, fields.holder)
    }
    back, left_alone = [], []
    for workload_id, before, after in held:
        mode, holder = current.get(workload_id, (None, None))
        if mode is None:
            continue  # no longer in the fleet
        if holder == change.id and mode == after:
            back.append((workload_id, after, before))
        else:
            moved_by = str(holder) if holder else None
            left_alone.append({"workload_id": str(workload_id), "mode": mode, "moved_by": moved_by})
    modes_back = {before for _, _, before in back}
    revert = ModeChange.objects.create(
        actor=SYSTEM_ACTOR.label,
        created_at=now,
        selection={"workload_ids": sorted(str(workload_id) for workload_id, _, _ in held)},
        mode=next(iter(modes_back)) if len(modes_back) == 1 else None,
        resolved_count=len(held),
        changed_count=len(back),
        reverts=change,
        direction=change.direction,
        reason=f"Mode change {change.id} was not confirmed by {clock.rfc3339(change.confirm_by)}.",
        left_alone=left_alone,
    )
    for mode in modes_back:
        Workload.objects.filter(id__in=[w for w, _, before in back if before == mode]).update(
            **{fields.mode: mode, fields.since: now, fields.holder: revert}
        )
    ModeChangeWorkload.objects.bulk_create(
        [
            ModeChangeWorkload(
                mode_change=revert,
                workload_id=w,
                mode_before=after,
                mode_after=before,
                direction=change.direction,
            )
            for w, after, before in back
        ],
        batch_size=2000,
    )
    workloads_rerender(workload_ids=[str(w) for w, _, _ in back])
    change.reverted_at = now
    change.save(update_fields=["reverted_at"])
    restored = [
        {"workload_id": str(w), "mode_before": after, "mode_after": before} for w, after, before in back
    ]
    audit_record(
        actor=SYSTEM_ACTOR,
        action="mode_change.revert",
        object_type="mode_change",
        object_id=revert.id,
        detail={
            "reverts": str(change.id),
            "reason": revert.reason,
            "workloads": restored,
            "left_alone": left_alone,
        },
    )
    webhook_event_record(
        "mode_change.reverted",
        {
            "mode_change": {
                "id": str(revert.id),
                "mode": revert.mode,
                "direction": revert.direction,
                "selection": revert.selection,
                "resolved_count": revert.resolved_count,
                "changed_workload_ids": [entry["workload_id"] for entry in restored],
                "reverts": str(change.id),
                "reason": revert.reason,
            },
            "workloads": restored,
            "left_alone": left_alone,
            "actor": SYSTEM_ACTOR.label,
        },
    )
    transaction.on_commit(
        lambda: log.info(
            "mode change %s was not confirmed by %s: put back %d workloads (mode change %s), left %d alone",
            change.id,
            clock.rfc3339(change.confirm_by),
            len(back),
            revert.id,
            len(left_alone),
        )
    )
    return revert

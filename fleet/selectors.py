"""Reads of the fleet: the workload list in fleet order, counts, one workload, its rendered policy,
what a selector matches now (POST /selectors/preview), and mode changes (one, or the list)."""

from __future__ import annotations

import uuid
from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.db.models import Count, Q, QuerySet
from django.db.models.fields.json import KeyTextTransform
from django.db.models.lookups import In

from controlplane.lookups import get_or_not_found
from controlplane.pagination import OrderKey, Page, list_fingerprint, paginate
from controlplane.problems import Finding, ValidationFailed
from controlplane.validation import Findings, quoted, reject_unknown, require_object, take_string
from fleet import health as flow_health
from fleet.choices import Mode, OwnedTableState, SyncState
from fleet.models import ModeChange, ModeChangeWorkload, Workload
from policy.grammar import GrammarError, Selector, parse_selector

# As many ids as a mode change's selection may name (fleet.services uses the same bound).
MAX_ID_FILTERS = 10_000
PREVIEW_LIMIT = 100
# Degraded and enforcement-removed first, then offline, pending, synced; by host name within each.
FLEET_ORDER = (OrderKey("rank"), OrderKey("hostname"), OrderKey("id", read=lambda w: str(w.id)))


def workload_flow_window(*, seconds: int) -> timedelta:
    """A workload's flow window: its agent's, as its latest report states it; the fleet's default for a
    workload that has not said."""
    return timedelta(seconds=seconds or settings.PALISADE_FLOW_WINDOW_SECONDS)


def label_filters_parse(texts: list[str]) -> list[Selector]:
    selectors, findings = [], []
    for index, text in enumerate(texts):
        try:
            selectors.append(parse_selector(text))
        except GrammarError as error:
            findings.append(Finding(f"?label[{index}]", error.rule, error.message))
    if findings:
        raise ValidationFailed(findings)
    return selectors


def _label_q(selector: Selector) -> Q:
    """A label selector as a database filter on the JSON labels column (SQLite and PostgreSQL)."""
    q = Q()
    containment = connection.vendor == "postgresql"  # jsonb @>, answered by the labels GIN index
    for r in selector.requirements:
        has = Q(labels__has_key=r.key)
        if containment and r.values:
            one_of = Q()
            for value in r.values:
                one_of |= Q(labels__contains={r.key: value})
        else:
            one_of = Q(In(KeyTextTransform(r.key, "labels"), list(r.values))) if r.values else Q()
        if r.op == "exists":
            q &= has
        elif r.op == "!exists":
            q &= ~has
        elif r.op in ("=", "in"):
            q &= has & one_of
        else:  # "!=" and "notin" also match workloads without the key
            q &= ~has | (has & ~one_of)
    return q


def workload_queryset(
    *,
    labels: list[Selector] = (),
    sync_state: str | None = None,
    removed: bool | None = None,
    ids: list[str] | None = None,
    outbound_mode: str | None = None,
) -> QuerySet:
    queryset = Workload.objects.select_related(None)
    if outbound_mode is not None:
        queryset = queryset.filter(outbound_mode=outbound_mode)
    if ids is not None:
        queryset = queryset.filter(id__in=ids)
    for selector in labels:
        queryset = queryset.filter(_label_q(selector))
    if sync_state is not None:
        queryset = queryset.filter(sync_state=sync_state)
    if removed is not None:
        queryset = (
            queryset.filter(owned_table_state=OwnedTableState.ABSENT)
            if removed
            else queryset.exclude(owned_table_state=OwnedTableState.ABSENT)
        )
    return queryset


def workload_ids_parse(texts: list[str]) -> list[str] | None:
    """The repeatable `id` filter: None when not given; an id that is not a UUID is a finding (an id
    that names no workload is simply not listed, as a selection's `workload_ids` resolve)."""
    if not texts:
        return None
    findings, ids = [], []
    if len(texts) > MAX_ID_FILTERS:
        findings.append(Finding("?id", "type", f"Give at most {MAX_ID_FILTERS} ids."))
    for index, text in enumerate(texts[:MAX_ID_FILTERS]):
        try:
            ids.append(str(uuid.UUID(text)))
        except ValueError:
            findings.append(Finding(f"?id[{index}]", "type", f"{quoted(text)} is not a workload id."))
    if findings:
        raise ValidationFailed(findings)
    return sorted(set(ids))


def workload_filters_parse(
    *,
    labels: list[str],
    sync_state: str | None,
    removed: str | None,
    ids: list[str] = (),
    outbound_mode: str | None = None,
) -> dict:
    findings = []
    parsed: dict = {"labels": label_filters_parse(labels), "ids": workload_ids_parse(list(ids))}
    if sync_state not in (None, "") and sync_state not in SyncState.values:
        findings.append(
            Finding("?sync_state", "sync-state", f"sync_state must be one of {', '.join(SyncState.values)}.")
        )
    parsed["sync_state"] = sync_state or None
    if outbound_mode not in (None, "") and outbound_mode not in Mode.values:
        findings.append(
            Finding(
                "?outbound_mode", "outbound-mode", f"outbound_mode must be one of {', '.join(Mode.values)}."
            )
        )
    parsed["outbound_mode"] = outbound_mode or None
    if removed not in (None, "", "true", "false"):
        findings.append(Finding("?removed", "type", "removed must be true or false."))
    parsed["removed"] = None if removed in (None, "") else removed == "true"
    if findings:
        raise ValidationFailed(findings)
    return parsed


def workload_list(
    *,
    labels: list[Selector] = (),
    sync_state=None,
    removed=None,
    ids=None,
    outbound_mode=None,
    cursor=None,
    limit=100,
) -> Page:
    criteria = {"labels": [str(s) for s in labels], "sync_state": sync_state, "removed": removed, "ids": ids}
    if outbound_mode is not None:  # absent, the fingerprint (and so every cursor) is what it always was
        criteria["outbound_mode"] = outbound_mode
    fingerprint = list_fingerprint("workloads", criteria)
    return paginate(
        workload_queryset(
            labels=labels, sync_state=sync_state, removed=removed, ids=ids, outbound_mode=outbound_mode
        ),
        order=FLEET_ORDER,
        cursor=cursor,
        limit=limit,
        fingerprint=fingerprint,
    )


def workload_counts() -> dict:
    """Total, per sync state, and removed; a removed workload counts in `removed` and in no state."""
    # One GROUP BY over the (sync_state, owned_table_state) index rather than six filtered counts;
    # COUNT(*), not COUNT(id), so PostgreSQL answers from the index alone.
    groups = Workload.objects.order_by().values_list("sync_state", "owned_table_state").annotate(n=Count("*"))
    counts = {"total": 0, "sync_state": dict.fromkeys(SyncState.values, 0), "removed": 0}
    for sync_state, table_state, n in groups:
        counts["total"] += n
        if table_state == OwnedTableState.ABSENT:
            counts["removed"] += n
        elif sync_state in counts["sync_state"]:
            counts["sync_state"][sync_state] += n
    return counts


# A workload shows a clock skew while its latest report's clock was off by over two windows
# (flows/services.py sets the offset then, and clears it on a report within them).
CLOCK_SKEWED = Q(clock_skew_seconds__isnull=False)


def telemetry_live_filter(*, now) -> Q:
    """fleet/representations.py's `telemetry_live` as a database filter: a report within two of the
    workload's own flow windows (fleet/health.py), one condition per window length the fleet reports."""
    lengths = Workload.objects.order_by().values_list("flow_window_seconds", flat=True).distinct()
    live = Q(pk__isnull=True)  # no workload: nothing is live
    for seconds in lengths:
        since = flow_health.telemetry_live_since(window=workload_flow_window(seconds=seconds), now=now)
        live |= Q(flow_window_seconds=seconds, last_flow_report_at__gte=since)
    return live


def offline_for_more_than_filter(*, seconds: int, now) -> Q:
    """Counted offline in /workloads/counts (stored offline, enforcement not removed) and not heard
    from for more than `seconds`: since its stream ended, or since enrolment if it never connected."""
    before = now - timedelta(seconds=seconds)
    return (
        Q(sync_state=SyncState.OFFLINE)
        & ~Q(owned_table_state=OwnedTableState.ABSENT)
        & (Q(last_heard_from__lt=before) | Q(last_heard_from__isnull=True, enrolled_at__lt=before))
    )


def workload_get(*, workload_id, for_update: bool = False, missing: str = "") -> Workload:
    """One workload. Writes pass `for_update`: the row stays locked until their transaction ends."""
    queryset = Workload.objects.all() if for_update else Workload.objects.select_related("latest_policy")
    return get_or_not_found(queryset, workload_id, what="workload", detail=missing, for_update=for_update)


def workloads_holding(*, addresses: list[str], excluding: uuid.UUID | None = None) -> dict[str, Workload]:
    """The active workloads (credential not revoked) other than `excluding` that hold any of
    `addresses` (normalised, as stored), by the address they hold; the earliest enrolled when several
    do. PostgreSQL finds them with `?|` (top-level array elements of the jsonb), SQLite with
    json_each."""
    if not addresses:
        return {}
    active = Workload.objects.filter(credential_revoked_at__isnull=True)
    if excluding is not None:
        active = active.exclude(id=excluding)
    if connection.vendor == "postgresql":
        holders = active.filter(addresses__has_any_keys=list(addresses))
    else:
        table = Workload._meta.db_table
        marks = ", ".join(["%s"] * len(addresses))
        # The table's name and the placeholders only; the addresses are parameters.
        held_any = f'EXISTS (SELECT 1 FROM json_each("{table}"."addresses") WHERE value IN ({marks}))'  # noqa: S608
        holders = active.extra(where=[held_any], params=list(addresses))  # noqa: S610
    wanted = set(addresses)
    held: dict[str, Workload] = {}
    for workload in holders.order_by("enrolled_at", "id").only("id", "hostname", "addresses"):
        for address in workload.addresses:
            if address in wanted:
                held.setdefault(address, workload)
    return held


def selector_preview(*, selector: Selector, limit: int = 100) -> tuple[int, list[Workload]]:
    matched = workload_queryset(labels=[selector]).order_by("hostname", "id")
    return matched.count(), list(matched[:limit])


def selector_preview_request(*, data) -> dict:
    """POST /selectors/preview (and `manage.py selector-preview`): what a selector matches now."""
    data = require_object(data)
    findings = Findings()
    reject_unknown(data, {"selector"}, findings)
    text = take_string(data, "selector", findings, max_length=4096)
    findings.raise_if_any()
    try:
        selector = parse_selector(text)
    except GrammarError as error:
        raise ValidationFailed([Finding("/selector", error.rule, error.message)]) from None
    count, sample = selector_preview(selector=selector, limit=PREVIEW_LIMIT)
    return {
        "selector": str(selector),
        "count": count,
        "workloads": [{"id": str(w.id), "hostname": w.hostname, "labels": w.labels} for w in sample],
        "truncated": count > len(sample),
    }


# The states of a mode change's confirmation (null: it needs none), and how each is read off the row.
CONFIRMATION_STATES = {
    "awaiting": Q(confirm_by__isnull=False, confirmed_at__isnull=True, reverted_at__isnull=True),
    "confirmed": Q(confirmed_at__isnull=False),
    "reverted": Q(reverted_at__isnull=False),
}
MODE_CHANGE_ORDER = (OrderKey("created_at", descending=True), OrderKey("id", descending=True))


def mode_change_get(*, mode_change_id) -> ModeChange:
    return get_or_not_found(ModeChange.objects.select_related("revert"), mode_change_id, what="mode change")


def mode_change_list(*, confirmation: str | None, cursor: str | None, limit: int) -> Page:
    """Mode changes, newest first; `confirmation` narrows them to one state (`awaiting`: the ones
    whose deadline has not been met either way, the ones a console counts down)."""
    changes = ModeChange.objects.select_related("revert")
    if confirmation not in (None, ""):
        if confirmation not in CONFIRMATION_STATES:
            raise ValidationFailed(
                [
                    Finding(
                        "?confirmation",
                        "confirmation",
                        f"confirmation is one of {', '.join(CONFIRMATION_STATES)}.",
                    )
                ]
            )
        changes = changes.filter(CONFIRMATION_STATES[confirmation])
    return paginate(
        changes,
        order=MODE_CHANGE_ORDER,
        cursor=cursor,
        limit=limit,
        fingerprint=list_fingerprint("mode-changes", {"confirmation": confirmation or ""}),
    )


def mode_change_workloads(*, change: ModeChange) -> list[tuple[str, str, str]]:
    """(workload id, mode before, mode after) of each workload a change with a deadline would put
    back, or a revert put back; by workload id."""
    return [
        (str(workload_id), before, after)
        for workload_id, before, after in ModeChangeWorkload.objects.filter(mode_change=change)
        .order_by("workload_id")
        .values_list("workload_id", "mode_before", "mode_after")
    ]

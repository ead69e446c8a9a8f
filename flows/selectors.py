"""Reads of stored flow evidence: one workload's windows, the gaps of a set of workloads, rollups and
the simulation review. Their query parameters are parsed in flows/validation.py; the sums a rollup
reads, and the ladder of their spans, are flows/sums/."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import F, Max, OuterRef, Prefetch, Q, Subquery, UUIDField

from controlplane import clock
from controlplane.clock import rfc3339
from controlplane.pagination import OrderKey, Page, cursor_encode, decode_cursor, list_fingerprint, paginate
from fleet import health
from fleet.choices import Mode, SyncState
from fleet.models import Workload
from fleet.selectors import workload_flow_window, workload_get, workload_queryset
from flows.buckets import whole_spans
from flows.choices import AGGREGATE, ANY_DIRECTION, Decision, Direction
from flows.models import (
    EvidenceGap,
    FlowGroup,
    FlowWindow,
)
from flows.retention import flow_retention
from flows.sums.ladder import BLOCK
from flows.sums.reads import Summed, added_up, key_sums, null_last, spans_summed
from flows.validation import GROUP_KEYS, direction_filters, workload_required
from policy.grammar import Selector
from policy.models import Rule

WINDOW_ORDER = (OrderKey("start"), OrderKey("id", read=lambda w: str(w.id)))
GAP_ORDER = (OrderKey("start"), OrderKey("id", read=lambda g: str(g.id)))


def flow_windows_list(
    *,
    workload_id: str,
    start: datetime,
    end: datetime,
    cursor: str | None,
    limit: int,
    groups: dict | None = None,
    direction: str = Direction.INBOUND,
) -> Page:
    """One workload's stored windows that intersect [start, end), in time order, with their groups
    (only those matching `groups`, and only windows with one, when filters are given). Only the groups
    of `direction` (inbound by default; `any`: both), and so only windows with one."""
    workload_required(workload_id)
    workload = workload_get(workload_id=workload_id, missing=f"No workload {workload_id}.")
    fingerprinted = {**(groups or {}), **({} if direction == Direction.INBOUND else {"dir": direction})}
    groups = {**(groups or {}), **direction_filters(direction)}
    matching = FlowGroup.objects.filter(**groups)
    lookback = timedelta(seconds=workload.flow_window_seconds_longest)
    windows = FlowWindow.objects.filter(workload=workload, **_windows_in(start, end, lookback))
    if groups:
        windows = windows.filter(
            id__in=matching.filter(workload=workload, **_starts_in(start, end, lookback)).values("window_id")
        )
    windows = windows.prefetch_related(
        Prefetch("groups", queryset=matching.order_by("peer", "protocol", "port", "decision", "rule_number"))
    )
    fingerprint = list_fingerprint(
        "flows",
        {"workload": str(workload.id), "from": start.isoformat(), "to": end.isoformat(), **fingerprinted},
    )
    return paginate(windows, order=WINDOW_ORDER, cursor=cursor, limit=limit, fingerprint=fingerprint)


def evidence_gaps_list(
    *,
    workload_ids: list[str],
    labels: list[Selector],
    start: datetime,
    end: datetime,
    cursor: str | None,
    limit: int,
) -> Page:
    """The gaps of the selected workloads (ids and labels ANDed; none: the whole fleet) that
    intersect [start, end), in time order."""
    gaps = EvidenceGap.objects.filter(start__lt=end, end__gt=start)
    selected = workloads_selected(workload_ids=workload_ids, labels=labels)
    if selected is not None:
        gaps = gaps.filter(workload__in=selected)
    fingerprint = list_fingerprint(
        "flows-gaps",
        {
            "workloads": sorted(workload_ids),
            "labels": sorted(str(s) for s in labels),
            "from": start.isoformat(),
            "to": end.isoformat(),
        },
    )
    return paginate(gaps, order=GAP_ORDER, cursor=cursor, limit=limit, fingerprint=fingerprint)


def rule_ids_by_number(numbers: set[int]) -> dict[int, str]:
    """The rules that hold these lifetime numbers now (a deleted rule's number names nothing)."""
    return {number: rule_id for number, (rule_id, _) in rules_by_number(numbers).items()}


def rules_by_number(numbers: set[int]) -> dict[int, tuple[str, str]]:
    """The (id, action) of the rules that hold these lifetime numbers now."""
    numbers.discard(None)  # type: ignore[arg-type]
    if not numbers:
        return {}
    return {
        number: (str(rule_id), action)
        for number, rule_id, action in Rule.objects.filter(Q(number__in=numbers)).values_list(
            "number", "id", "action"
        )
    }


def with_rule_actions(rows: list[dict]) -> list[dict]:
    """Rows keyed by `rule_number` get the `rule_action` of the rule it names now (allow or deny; None:
    no rule, or a deleted one), so that a deny rule's rows read as refusals."""
    if not rows or "rule_number" not in rows[0]:
        return rows
    rules = rules_by_number({row["rule_number"] for row in rows})
    for row in rows:
        found = rules.get(row["rule_number"])
        row["rule_action"] = found[1] if found else None
    return rows


# --- rollups and the simulation review ---

COVERAGE_LIST = 100
WOULD_BLOCK_LIST = 1000


def workloads_selected(*, workload_ids: list[str], labels: list[Selector]):
    """The selected workloads' ids as a queryset (ids and labels ANDed); None selects the whole fleet."""
    if not workload_ids and not labels:
        return None
    selected = workload_queryset(labels=labels)
    if workload_ids:
        selected = selected.filter(id__in=_workloads_named(workload_ids))
    return selected.values("id")


def _workloads_named(workload_ids: list[str]) -> list[uuid.UUID]:
    """The ids (distinct, bounded: flows/validation.py) in one query; the first that names no workload
    is not found, as `workload_get` says it."""
    keys = {}
    for text in workload_ids:
        try:
            keys[text] = uuid.UUID(text)
        except ValueError:
            keys[text] = None
    found = set(Workload.objects.filter(id__in=[k for k in keys.values() if k]).values_list("id", flat=True))
    for text, key in keys.items():
        if key not in found:
            workload_get(workload_id=text)  # raises its not-found problem
    return list(found)


def _starts_in(start: datetime, end: datetime, lookback: timedelta) -> dict:
    """Windows (or their groups) that may intersect [start, end): a lower bound on `start` as well,
    `lookback` (the longest window) before the range, so that an index or a partition is read from
    there: with the hour a window may last instead, every range's leading edge read an hour of rows
    only to drop them."""
    return {"start__lt": end, "start__gt": start - lookback}


def _windows_in(start: datetime, end: datetime, lookback: timedelta) -> dict:
    return {**_starts_in(start, end, lookback), "end__gt": start}


def _lookback(selected) -> timedelta:
    """The longest window the selected workloads ever reported (flows/services.py keeps it per workload)."""
    longest = _workloads_of(selected).aggregate(longest=Max("flow_window_seconds_longest"))["longest"]
    return timedelta(seconds=longest or 0)


@dataclass(frozen=True)
class FlowRange:
    """A range of the selected workloads' evidence (`selected` None: the whole fleet), planned once for
    every read of it: the longest window they reported, how far before the range a window that
    intersects it may start, is one query."""

    selected: object
    start: datetime
    end: datetime
    lookback: timedelta
    direction: str = Direction.INBOUND  # whose connections every read of it covers (`any`: both)

    @property
    def blocks(self) -> tuple[datetime, datetime] | None:
        """The range's whole blocks, the shortest span of the sums; None when it holds none and every
        read of it is of minute rows."""
        return whole_spans(self.start, self.end, BLOCK)


def flow_range_plan(
    *, selected, start: datetime, end: datetime, direction: str = Direction.INBOUND
) -> FlowRange:
    return FlowRange(
        selected=selected, start=start, end=end, lookback=_lookback(selected), direction=direction
    )


def groups_in_range(planned: FlowRange):
    """The minute rows (groups) of the range's direction in the windows that intersect the range."""
    groups = FlowGroup.objects.filter(
        **_windows_in(planned.start, planned.end, planned.lookback), **direction_filters(planned.direction)
    )
    return groups if planned.selected is None else groups.filter(workload__in=planned.selected)


def _workloads_of(selected):
    return Workload.objects.all() if selected is None else Workload.objects.filter(id__in=selected)


def coverage(selected, start: datetime, end: datetime, *, lookback: timedelta | None = None) -> dict:
    """What makes a total incomplete: the gaps intersecting the range, the selected workloads that
    sent no window in it, those silent in it still (`_silent_workloads`), and a start before the
    retention's."""
    gaps = EvidenceGap.objects.filter(start__lt=end, end__gt=start)
    workloads = _workloads_of(selected)
    if selected is not None:
        gaps = gaps.filter(workload__in=selected)
    # One probe of the (workload, start) index per workload, for its first window in the range: a day
    # of a thousand workloads' windows is over a million rows. A scalar subquery with LIMIT 1 stays a
    # probe that stops at the first row whatever the statistics; NOT EXISTS PostgreSQL may turn into an
    # anti-join, and with some statistics it hashed every window of the range (1.2 s, not 20 ms).
    reporting = FlowWindow.objects.filter(
        workload_id=OuterRef("id"),
        **_windows_in(start, end, _lookback(selected) if lookback is None else lookback),
    )
    first_report = Subquery(reporting.order_by("start").values("id")[:1])
    without_reports = (
        workloads.annotate(first_report=first_report).filter(first_report=None).order_by("hostname", "id")
    )
    gap_count, without_reports_count = gaps.count(), without_reports.count()
    silent = _silent_workloads(workloads, end)
    pending = _pending_workloads(workloads, end)
    # Retention removes what ended before this; a range that begins earlier has lost that part.
    retained_from = clock.now() - flow_retention()
    complete = not (gap_count or without_reports_count or silent or pending) and start >= retained_from
    return {
        "complete": complete,
        "retained_from": retained_from,
        "begins_before_retention": start < retained_from,
        "gap_count": gap_count,
        # Listed only when there is something to list: each list is its count's query again (for the
        # workloads, a probe per workload), and a complete range, the common answer, has neither.
        "gaps": list(gaps.order_by("start", "id")[:COVERAGE_LIST]) if gap_count else [],
        "workloads_without_reports_count": without_reports_count,
        "workloads_without_reports": [
            str(w) for w in without_reports.values_list("id", flat=True)[:COVERAGE_LIST]
        ]
        if without_reports_count
        else [],
        "silent_workloads_count": len(silent),
        "silent_workloads": silent[:COVERAGE_LIST],
        "pending_workloads_count": len(pending),
        "pending_workloads": pending[:COVERAGE_LIST],
    }


def _pending_workloads(workloads, end: datetime) -> list[dict]:
    """The workloads whose agent, by its stream's heartbeats, holds flow windows or gaps from before the
    range's end that the control plane has not received: its flow reports are held back (a proxy or a
    firewall that lets the stream through but not new connections) while it stays connected and
    synced. No gap is due (they may yet arrive), but until they do the range's totals lack them."""
    held = workloads.filter(flow_backlog_since__lt=end).order_by("hostname", "id")
    return [
        {"workload_id": workload_id, "hostname": hostname, "since": since}
        for workload_id, hostname, since in held.values_list("id", "hostname", "flow_backlog_since")
    ]


def _silent_workloads(workloads, end: datetime) -> list[dict]:
    """The workloads whose agent has gone silent before the range's end (or now) and not come back:
    offline, with no flow report and no heartbeat of the process that reported for more than two of its
    windows (not when its stream's end was recorded: a crashed serve's streams are recorded ended
    minutes later, by the next one's housekeeping). The control plane records that silence as an
    agent_silent gap only when the agent reports again (spec rule 2), so until then nothing else says
    that the range from its last sign of life holds no evidence. A workload that never sent a report is
    not here: it is among those without reports."""
    until = min(end, clock.now())
    offline = workloads.filter(sync_state=SyncState.OFFLINE, last_flow_report_at__isnull=False).values_list(
        "id", "hostname", "flow_window_seconds", "last_flow_report_at", "flow_process_alive_at"
    )  # fmt: skip
    silent = []
    for workload_id, hostname, seconds, last_report_at, alive_at in offline:
        since = health.silent_since(last_report_at=last_report_at, alive_at=alive_at)
        if health.gone_silent(since=since, window=workload_flow_window(seconds=seconds), until=until):
            silent.append({"workload_id": workload_id, "hostname": hostname, "since": since})
    return sorted(silent, key=lambda w: (w["hostname"], w["workload_id"]))


def ruleset_of_rule():
    # Typed, so that SQLite's stored text comes back as a UUID (and the API gives the id as /rulesets).
    return Subquery(
        Rule.objects.filter(number=OuterRef("rule_number")).values("ruleset_id")[:1], output_field=UUIDField()
    )


UUID_COLUMNS = frozenset({"workload_id", "peer_workload_id", "ruleset_id"})


def _summed_by_spans(planned: FlowRange, columns: list[str], **options) -> Summed:
    """The range's groups summed by `columns` from the sums (flows/sums/reads.py `spans_summed`, which
    takes `options`), for a range that holds a whole ten-minute block."""
    return spans_summed(
        groups=groups_in_range(planned),
        selected=planned.selected,
        blocks=planned.blocks,  # type: ignore[arg-type]
        columns=columns,
        annotate={"ruleset_id": ruleset_of_rule} if "ruleset_id" in columns else None,
        **direction_filters(planned.direction),
        **options,
    )


def _after_key(columns: list[str], last: list) -> Q:
    """Groups whose key comes after `last` in column order, nulls last: (a > x) or (a = x and b > y) ...
    A null is after every value, and nothing is after a null but what ties it."""
    condition = Q(pk__in=[])  # nothing, until a step adds something
    for index, (column, value) in enumerate(zip(columns, last, strict=True)):
        if value is None:
            continue
        step = Q(**{f"{column}__gt": value}) | Q(**{f"{column}__isnull": True})
        for previous, earlier in zip(columns[:index], last[:index], strict=True):
            step &= Q(**{f"{previous}__isnull": True}) if earlier is None else Q(**{previous: earlier})
        condition |= step
    return condition


@dataclass(frozen=True)
class Rollup:
    """A rollup as GET /flows/rollup answers it: a page of sums (every row when read unpaged), the
    cursor of the next page, the rules the rows' numbers name now, the range's coverage, and the rules
    without hits (None unless grouped by `rule` alone over a fully covered range: a rule without hits
    may only have gone unseen)."""

    rows: list[dict]
    next_cursor: str | None
    rule_ids: dict[int, str]
    coverage: dict
    unused_rules: list[Rule] | None
    # Read unpaged (`limit` None), at most ROLLUP_ROWS rows: how many more there were.
    rows_left_out: int = 0


# The rows a rollup read unpaged (`manage.py flows rollup`, one document) holds at most: past them
# it says how many it left out. A page of the API is bounded by its `limit`, and only that page's rows
# (one more) are read.
ROLLUP_ROWS = 100_000


def flow_rollup_read(
    *,
    selected,
    group_by: list[str],
    start: datetime,
    end: datetime,
    cursor: str | None,
    limit: int | None,
    direction: str = Direction.INBOUND,
) -> Rollup:
    """The rollup of the selected workloads over [start, end) with everything said of it, from one plan
    of the range for all its reads. `limit` None reads every row up to ROLLUP_ROWS (the command's one
    document), and counts the rows left out.

    Grouped by `rule` alone over a fully covered range, the rules hit are the rollup's own rows, read
    once, every page of them (a row per rule number): the sums are not read a second time for them.
    Past ROLLUP_ROWS rule numbers the rules without hits are not said (None). Every row, rule hit and
    rule without hits is of `direction`'s connections; the coverage is of both (a gap loses both)."""
    planned = flow_range_plan(selected=selected, start=start, end=end, direction=direction)
    covered = coverage(selected, start, end, lookback=planned.lookback)
    columns, fingerprint, last = _rollup_key(planned, group_by, cursor)
    unused, left_out = None, 0
    if group_by == ["rule"] and covered["complete"]:
        every = _rollup_rows(planned, columns, last=None, most=ROLLUP_ROWS)
        if not every.truncated:
            unused = _rules_without_hits({row["rule_number"] for row in every.rows}, planned.direction)
        rows = _after(every.rows, columns, last)
        rows = rows if limit is None else rows[: limit + 1]
        left_out = every.key_count - len(every.rows)
    else:
        read = _rollup_rows(planned, columns, last=last, most=ROLLUP_ROWS if limit is None else limit + 1)
        rows = read.rows
        left_out = read.key_count - len(read.rows) if limit is None else 0
    rows, next_cursor = _page_end(rows, columns, fingerprint, limit)
    return Rollup(
        rows=with_rule_actions(rows),
        next_cursor=next_cursor,
        rule_ids=rule_ids_by_number({row.get("rule_number") for row in rows}),
        coverage=covered,
        unused_rules=unused,
        rows_left_out=left_out,
    )


def flow_rollup(
    *,
    selected,
    group_by: list[str],
    start: datetime,
    end: datetime,
    cursor: str | None,
    limit: int,
    direction: str = Direction.INBOUND,
) -> tuple[list[dict], str | None]:
    """A page of the rollup's rows alone, and the next page's cursor (`flow_rollup_read` says the rest)."""
    planned = flow_range_plan(selected=selected, start=start, end=end, direction=direction)
    columns, fingerprint, last = _rollup_key(planned, group_by, cursor)
    rows = _rollup_rows(planned, columns, last=last, most=limit + 1).rows
    return _page_end(rows, columns, fingerprint, limit)


def _rollup_key(
    planned: FlowRange, group_by: list[str], cursor: str | None
) -> tuple[list[str], str, list | None]:
    """The key columns of `group_by`, the rollup's fingerprint, and the last key of the previous page.
    Paged by key: the cursor holds the last key of the page, so groups that appear while a client
    pages never shift the pages."""
    columns = [column for name in group_by for column in GROUP_KEYS[name]]
    selected = planned.selected
    fingerprint = list_fingerprint(
        "flows-rollup",
        {
            "by": group_by,
            "from": planned.start.isoformat(),
            "to": planned.end.isoformat(),
            "sel": str(selected.query) if selected is not None else "",  # type: ignore[attr-defined]
            # Not for inbound, so that a cursor given before directions existed still reads on.
            **({} if planned.direction == Direction.INBOUND else {"dir": planned.direction}),
        },
    )
    last = None
    if cursor:
        last = [
            uuid.UUID(value) if column in UUID_COLUMNS and isinstance(value, str) else value
            for column, value in zip(columns, decode_cursor(cursor, fingerprint, len(columns)), strict=True)
        ]
    return columns, fingerprint, last


def _rollup_rows(planned: FlowRange, columns: list[str], *, last: list | None, most: int) -> Summed:
    """Sums of the range's groups by `columns`, in the order of their keys (nulls last), after the key
    `last`, at most `most` of them, and how many keys there were. Whole blocks come from the sums
    (`_summed_by_spans`, the bound and the count in its statement on PostgreSQL); a range without one,
    or a series by window start, from the minute rows (counted only when over the bound)."""
    if planned.blocks is None or "start" in columns:
        groups = groups_in_range(planned)
        if "ruleset_id" in columns:
            groups = groups.annotate(ruleset_id=ruleset_of_rule())
        if last is not None:
            groups = groups.filter(_after_key(columns, last))
        summed = key_sums(groups, columns)
        ordered = summed.order_by(*[F(column).asc(nulls_last=True) for column in columns])
        rows = list(ordered[:most])
        count = summed.count() if len(rows) == most else len(rows)
        return Summed(rows=rows, key_count=count, connection_count=0)
    return _summed_by_spans(planned, columns, most=most, after=last)


def _after(rows: list[dict], columns: list[str], last: list | None) -> list[dict]:
    """Of rows in key order, those whose key comes after `last` (nulls last), as `_after_key` in SQL."""
    if last is None:
        return rows
    bound = null_last(last)
    return [row for row in rows if null_last(row[c] for c in columns) > bound]


def _page_end(
    rows: list[dict], columns: list[str], fingerprint: str, limit: int | None
) -> tuple[list[dict], str | None]:
    """A page of at most `limit` of `rows` (read one past it) and the cursor after it, if more follow."""
    if limit is None or len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    return rows, cursor_encode(fingerprint, [rows[-1][column] for column in columns])


def _rules_without_hits(hit: set, direction: str = Direction.INBOUND) -> list[Rule]:
    """Rules of rulesets of `direction` (every one with `any`) whose numbers are not among those `hit`
    (the caller says so only when coverage is complete). An outbound connection admitted by its
    destination's inbound rule ("one rule, both ends") is no hit of that rule in an inbound read."""
    hit.discard(None)
    rules = Rule.objects.exclude(number__in=hit)
    if direction != ANY_DIRECTION:
        rules = rules.filter(ruleset__direction=direction)
    return list(rules.select_related("ruleset").order_by("ruleset__name", "position"))


def _summed(
    planned: FlowRange,
    columns: list[str],
    *conditions: Q,
    most: int | None = None,
    by_connections: bool = False,
    **filters,
) -> Summed:
    """The range's groups summed by `columns` (`conditions` and `filters` narrowing them), at most
    `most` of them, by key or with `by_connections` most connections first. A range holding a whole
    ten-minute block reads the sums, as the rollup does: a day of a thousand workloads is millions of
    minute rows but a hundred thousand hour rows."""
    if planned.blocks is None:
        parts = key_sums(groups_in_range(planned).filter(*conditions, **filters), columns)
        return added_up(parts, columns, most=most, by_connections=by_connections)
    return _summed_by_spans(
        planned, columns, conditions=conditions, most=most, by_connections=by_connections, **filters
    )


# The keys (workload, peer, service) the reads of draft policy judge at most, most connections first:
# the impact judges each key twice and the suggestions build evidence of each, so an agent that
# reports many distinct keys would otherwise make either read's time and answer grow with them.
KEYS_READ = 20_000


def flow_keys_summed(planned: FlowRange, columns: list[str], **filters) -> Summed:
    """The groups of the planned range summed by `columns` (`filters` narrow them by key columns), read
    as the rollup reads them, at most KEYS_READ keys, those of most connections first, with the count of
    every key and of their connections: for the impact of a draft policy
    (flows/policy_drafts/impact.py) and suggested rules (flows/policy_drafts/suggestions.py). A
    window's aggregate key (peer `*`: its keys over the ingestion bound, summed) is no peer and no
    service: it is left out in the query, neither read nor counted (its range's `keys_aggregated` gap
    already says the evidence is not whole)."""
    return _summed(planned, columns, ~Q(peer=AGGREGATE), most=KEYS_READ, by_connections=True, **filters)


def _review_decisions(planned: FlowRange, elsewhere_ids: set) -> tuple[list, list]:
    """In one read of the range: its would-block groups by workload, peer and service, most connections
    first; and per workload and decision, the connections that the table of a workload in simulation
    throughout (not in `elsewhere_ids`) decided as another mode's does (observed: visibility, blocked:
    enforced). Its agent had not applied the change yet (it applies it seconds later, or not at all
    while away or degraded), so what simulation would have said of them is unknown."""
    # Read both ways, each of its own direction: the same peer and service may be both.
    both = planned.direction == ANY_DIRECTION
    rows = _summed(
        planned, ["workload_id", "peer", "protocol", "port", "decision", "rule_number", *(["direction"] if both else [])],
        decision__in=[Decision.WOULD_BLOCK, Decision.OBSERVED, Decision.BLOCKED],
    ).rows  # fmt: skip
    # A would-block row names the deny rule that refused its connections (rule_number), or none.
    would_block = with_rule_actions([
        {key: value for key, value in row.items() if key != "decision"}
        for row in rows
        if row["decision"] == Decision.WOULD_BLOCK
    ])  # fmt: skip
    decided: dict[tuple, int] = {}
    for row in rows:
        if row["decision"] != Decision.WOULD_BLOCK and row["workload_id"] not in elsewhere_ids:
            key = (row["workload_id"], row["decision"])
            decided[key] = decided.get(key, 0) + row["connection_count"]
    return (
        sorted(would_block, key=lambda r: (-r["connection_count"], str(r["workload_id"]), r["peer"], r["protocol"], r["port"], r["rule_number"] or 0, r.get("direction", ""))),
        [{"workload_id": w, "decision": d, "connection_count": n} for (w, d), n in sorted(decided.items(), key=lambda i: (str(i[0][0]), i[0][1]))],
    )  # fmt: skip


# The workload's mode of each direction, and since when it holds it.
_MODE_FIELDS = {
    Direction.INBOUND: ("mode", "mode_since"),
    Direction.OUTBOUND: ("outbound_mode", "outbound_mode_since"),
}


def _simulating_throughout(direction: str, start: datetime) -> Q:
    """In simulation for the whole range, in the direction's mode (both with `any`): in it now, and
    since before the range began."""
    condition = Q()
    for mode, since in [_MODE_FIELDS[direction]] if direction in _MODE_FIELDS else _MODE_FIELDS.values():
        condition &= Q(**{mode: Mode.SIMULATION}) & (
            Q(**{f"{since}__lte": start}) | Q(**{since: None}, enrolled_at__lte=start)
        )
    return condition


def simulation_review(
    *, selected, start: datetime, end: datetime, direction: str = Direction.INBOUND
) -> dict:
    """The review before enforcing: would-block groups, gaps, offline workloads and workloads not in
    simulation; any one fails it (a gap alone does: rule 5). The would-block groups and the connections
    decided outside simulation are `direction`'s; gaps fail it whatever the direction (a gap loses
    both). Which workloads were in simulation throughout is read from the mode of that direction:
    `mode` inbound, `outbound_mode` outbound, both with `any`."""
    workloads = _workloads_of(selected)
    planned = flow_range_plan(selected=selected, start=start, end=end, direction=direction)
    covered = coverage(selected, start, end, lookback=planned.lookback)
    offline = workloads.filter(sync_state=SyncState.OFFLINE).order_by("hostname", "id")
    simulating_throughout = _simulating_throughout(direction, start)
    elsewhere = workloads.exclude(simulating_throughout).order_by("hostname", "id")
    would_block, elsewhere_decided = _review_decisions(planned, set(elsewhere.values_list("id", flat=True)))
    # The lists are capped; the counts, and so the reasons, are exact: a script gating enforcement
    # reads them.
    would_block_count, offline_count = len(would_block), offline.count()
    elsewhere_count, selected_count = elsewhere.count(), workloads.count()
    counts = (
        (would_block_count, "would-block group: enforcing would block it", "would-block groups: enforcing would block them"),
        (covered["gap_count"], "evidence gap intersects the range", "evidence gaps intersect the range"),
        (covered["workloads_without_reports_count"], "workload sent no flow window in the range",
         "workloads sent no flow window in the range"),
        (covered["pending_workloads_count"], "workload holds flow evidence of the range not delivered yet",
         "workloads hold flow evidence of the range not delivered yet"),
        (offline_count, "workload is offline", "workloads are offline"),
        (elsewhere_count, "workload was not in simulation for the whole range",
         "workloads were not in simulation for the whole range"),
        (len({row["workload_id"] for row in elsewhere_decided}), "workload's table decided connections in the range outside simulation (observed or blocked)",
         "workloads' tables decided connections in the range outside simulation (observed or blocked)"),
    )  # fmt: skip
    # A selection of nothing would pass vacuously; the mode change it gates refuses it anyway.
    reasons = ["the selection matches no workload"] if selected_count == 0 else []
    reasons += [f"{count} {one if count == 1 else many}" for count, one, many in counts if count]
    if covered["begins_before_retention"]:
        reasons.append(
            f"the range begins before the retention: evidence before {rfc3339(covered['retained_from'])} is removed"
        )
    return {
        "verdict": "fail" if reasons else "pass",
        "reasons": reasons,
        "workload_count": selected_count,
        "would_block_count": would_block_count,
        "would_block": would_block[:WOULD_BLOCK_LIST],
        "rule_ids": rule_ids_by_number({row["rule_number"] for row in would_block[:WOULD_BLOCK_LIST]}),
        # Every one, for the second verdict against the policy in force now
        # (flows/policy_drafts/review_now.py); not rendered.
        "would_block_rows": would_block,
        "coverage": covered,
        "offline_count": offline_count,
        "offline": list(offline[:COVERAGE_LIST]),
        "direction": direction,
        "not_in_simulation_count": elsewhere_count,
        "not_in_simulation": list(elsewhere[:COVERAGE_LIST]),
        "decided_outside_simulation": elsewhere_decided[:COVERAGE_LIST],
    }

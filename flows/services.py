"""Ingestion of an agent's flow report: validated per window and gap, stored once, acknowledged.

A malformed window or gap is refused with its reason and the rest of the report still lands; the
agent drops what was refused (reporting a `window_rejected` gap for a refused window) and never
re-sends it. Ids are the agent's, so a re-send after a lost acknowledgement stores nothing twice;
reports of one workload are serialised on its row, so concurrent re-sends are safe too.
"""

from __future__ import annotations

import ipaddress
import uuid
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Max

from controlplane import clock, runtime
from controlplane.problems import Finding, ValidationFailed
from controlplane.validation import parse_instant
from fleet.models import Workload
from fleet.selectors import workload_get
from flows.choices import AGENT_GAP_KINDS, MAX_WINDOW_SECONDS, Decision, GapKind, GapSource
from flows.models import EvidenceGap, FlowGroup, FlowHour, FlowWindow
from flows.partitions import flow_partitions_drop, flow_partitions_ensure

MAX_WINDOWS_PER_REPORT = 1000
MAX_GAPS_PER_REPORT = 1000
MAX_RULE_NUMBER = (1 << 24) - 1
PROTOCOLS = ("tcp", "udp", "icmp", "icmpv6")
ACCEPTED, REFUSED = "accepted", "refused"


class Refused(ValueError):
    """One window or gap is malformed; the message says why (sent back to the agent)."""


@dataclass(frozen=True)
class Report:
    agent_clock: datetime
    process_start_id: str
    uptime_seconds: float
    window_seconds: int
    windows: list
    gaps: list


def _envelope(data: Any) -> Report:
    findings: list[Finding] = []
    if not isinstance(data, dict):
        raise ValidationFailed([Finding("", "type", "A flow report is a JSON object.")])
    if data.get("v") != 1 or data.get("type") != "flow_report":
        findings.append(Finding("/type", "protocol-version", "Expected a flow_report of agent protocol 1."))
    agent_clock = parse_instant(data.get("agent_clock"))
    if agent_clock is None:
        findings.append(Finding("/agent_clock", "instant", "agent_clock is not an RFC 3339 instant."))
    process = data.get("process_start_id")
    if not isinstance(process, str) or not 0 < len(process) <= 64:
        findings.append(
            Finding("/process_start_id", "type", "process_start_id is a string of 1-64 characters.")
        )
    uptime = data.get("uptime_seconds")
    if isinstance(uptime, bool) or not isinstance(uptime, int | float) or uptime < 0:
        findings.append(
            Finding("/uptime_seconds", "type", "uptime_seconds is a number of seconds, not negative.")
        )
    window_seconds = data.get("window_seconds")
    if (
        isinstance(window_seconds, bool)
        or not isinstance(window_seconds, int)
        or not 1 <= window_seconds <= MAX_WINDOW_SECONDS
    ):
        findings.append(
            Finding("/window_seconds", "out-of-range", "window_seconds is a whole number from 1 to 3600.")
        )
    for key, maximum in (("windows", MAX_WINDOWS_PER_REPORT), ("gaps", MAX_GAPS_PER_REPORT)):
        if not isinstance(data.get(key, []), list):
            findings.append(Finding(f"/{key}", "type", f"{key} is a list."))
        elif len(data.get(key, [])) > maximum:
            findings.append(Finding(f"/{key}", "too-many", f"At most {maximum} {key} per report."))
    unknown = set(data) - {
        "v",
        "type",
        "agent_clock",
        "process_start_id",
        "uptime_seconds",
        "window_seconds",
        "windows",
        "gaps",
    }
    for name in sorted(unknown)[:5]:
        findings.append(Finding(f"/{name}"[:80], "unknown-field", "Not a field of a flow report."))
    if findings:
        raise ValidationFailed(findings)
    return Report(
        agent_clock, process, float(uptime), window_seconds, data.get("windows", []), data.get("gaps", [])
    )


def _id(raw: Any) -> uuid.UUID:
    try:
        if isinstance(raw, str):
            return uuid.UUID(raw)
    except ValueError:
        pass
    raise Refused("id is not a UUID")


def _instant(raw: Any, name: str) -> datetime:
    parsed = parse_instant(raw)
    if parsed is None:
        raise Refused(f"{name} is not an RFC 3339 instant")
    return parsed


def _count(raw: Any, name: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw < 1 << 62:
        raise Refused(f"{name} is not a whole number from 0")
    return raw


def _peer(raw: Any) -> str:
    try:
        address = ipaddress.ip_address(raw if isinstance(raw, str) else "")
    except ValueError:
        raise Refused("peer is not an IP address") from None
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:
            raise Refused("peer carries a zone (%...): give the address alone")
        if address.ipv4_mapped:
            return address.ipv4_mapped.compressed
    return address.compressed


def _window(raw: Any, *, window_seconds: int) -> tuple[uuid.UUID, datetime, datetime, dict]:
    if not isinstance(raw, dict):
        raise Refused("a window is a JSON object")
    window_id = _id(raw.get("id"))
    start, end = _instant(raw.get("start"), "start"), _instant(raw.get("end"), "end")
    if end - start != timedelta(seconds=window_seconds):
        raise Refused(f"a window is {window_seconds} s long, from start to end")
    if not isinstance(raw.get("policy_version", ""), str) or len(raw.get("policy_version", "")) > 80:
        raise Refused("policy_version is a string of at most 80 characters")
    if not isinstance(raw.get("accounting"), bool):
        raise Refused("accounting is true or false")
    groups = raw.get("groups")
    most = settings.PALISADE_FLOW_WINDOW_MAX_KEYS
    if not isinstance(groups, list) or not groups or len(groups) > most:
        raise Refused(f"groups is a list of 1 to {most} keys")
    return window_id, start, end, raw


def _group(raw: Any, *, start: datetime, end: datetime, accounting: bool) -> dict:
    if not isinstance(raw, dict):
        raise Refused("a group is a JSON object")
    protocol = raw.get("protocol")
    if protocol not in PROTOCOLS and not (
        isinstance(protocol, str) and protocol.isdigit() and int(protocol) < 256
    ):
        raise Refused("protocol is tcp, udp, icmp, icmpv6 or a protocol number")
    port = raw.get("port")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise Refused("port is a whole number from 0 to 65535")
    if raw.get("decision") not in Decision.values:
        raise Refused(f"decision is one of {', '.join(Decision.values)}")
    rule = raw.get("rule")
    if rule is not None and (
        isinstance(rule, bool) or not isinstance(rule, int) or not 0 < rule <= MAX_RULE_NUMBER
    ):
        raise Refused("rule is a rule number or null")
    first_seen, last_seen = (
        _instant(raw.get("first_seen"), "first_seen"),
        _instant(raw.get("last_seen"), "last_seen"),
    )
    if not start <= first_seen <= last_seen <= end:
        raise Refused("first_seen and last_seen lie in the window, in that order")
    bytes_in, bytes_out = _count(raw.get("bytes_in"), "bytes_in"), _count(raw.get("bytes_out"), "bytes_out")
    if not accounting and (bytes_in or bytes_out):
        raise Refused("bytes are counted only with accounting")
    return {
        "peer": _peer(raw.get("peer")),
        "protocol": protocol,
        "port": port,
        "decision": raw["decision"],
        "rule_number": rule,
        "connection_count": _count(raw.get("connection_count"), "connection_count"),
        "first_seen": first_seen,
        "last_seen": last_seen,
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
    }


def _gap(raw: Any) -> tuple[uuid.UUID, dict]:
    if not isinstance(raw, dict):
        raise Refused("a gap is a JSON object")
    gap_id = _id(raw.get("id"))
    if raw.get("kind") not in AGENT_GAP_KINDS:
        raise Refused(f"kind is one of {', '.join(AGENT_GAP_KINDS)}")
    if raw.get("source") is not None and raw.get("source") not in GapSource.values:
        raise Refused("source is conntrack, nflog or null")
    start, end = _instant(raw.get("start"), "start"), _instant(raw.get("end"), "end")
    if not start < end:
        raise Refused("a gap ends after it starts")
    lost = raw.get("lost", {})
    if (
        not isinstance(lost, dict)
        or len(lost) > 8
        or not all(
            isinstance(k, str) and len(k) <= 16 and not isinstance(v, bool) and isinstance(v, int) and v >= 0
            for k, v in lost.items()
        )
    ):
        raise Refused("lost maps at most 8 names to whole numbers")
    return gap_id, {
        "kind": raw["kind"],
        "source": raw.get("source"),
        "start": start,
        "end": end,
        "lost": lost,
    }


_peer_map: tuple[tuple, dict[str, uuid.UUID]] = ((), {})


def _peer_workloads() -> dict[str, uuid.UUID]:
    """Address -> workload for the whole fleet, rebuilt only when the fleet changed: addresses are set
    at enrolment and re-enrolment only, both of which set `enrolled_at` to now, and workloads are never
    deleted, so the latest enrolment (read off an index) says whether the map is current."""
    global _peer_map
    stamp = tuple(Workload.objects.aggregate(latest=Max("enrolled_at")).values())
    if stamp != _peer_map[0]:
        addresses = Workload.objects.values_list("id", "addresses")
        _peer_map = (stamp, {address: wid for wid, listed in addresses for address in listed})
    return _peer_map[1]


def _result(raw: Any, outcome: str, reason: str = "") -> dict:
    item_id = raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) else None
    return {"id": item_id[:64] if item_id else None, "result": outcome, "reason": reason or None}


def _skew_fields(report: Report, now: datetime) -> dict:
    """Clock skew: the agent's clock off by more than two windows marks the workload; a report within
    the threshold clears it."""
    offset = (report.agent_clock - now).total_seconds()
    if abs(offset) > 2 * report.window_seconds:
        return {"clock_skew_seconds": round(offset, 3), "clock_skew_seen_at": now}
    return {"clock_skew_seconds": None, "clock_skew_seen_at": None}


def _latest_gap_fields(workload: Workload, gaps: list[EvidenceGap]) -> dict:
    if not gaps:
        return {}
    latest = max(gaps, key=lambda gap: gap.end)
    if workload.last_gap_end is not None and workload.last_gap_end >= latest.end:
        return {}
    return {"last_gap_kind": latest.kind, "last_gap_start": latest.start, "last_gap_end": latest.end}


def _uncovered(
    start: datetime, end: datetime, covered: list[tuple[datetime, datetime]]
) -> list[tuple[datetime, datetime]]:
    """The parts of [start, end) that no range of `covered` overlaps."""
    parts, cursor = [], start
    for low, high in sorted(covered):
        if high <= cursor:
            continue
        if low > cursor:
            parts.append((cursor, min(low, end)))
        cursor = max(cursor, high)
        if cursor >= end:
            break
    if cursor < end:
        parts.append((cursor, end))
    return [(low, high) for low, high in parts if low < high]


def _agent_silent(workload: Workload, report: Report, now: datetime) -> list[EvidenceGap]:
    """The spec's agent_silent, derived here and never taken from the agent. A report from the process
    that sent the previous one means that process ran throughout: a quiet workload, no gap. From another
    process (a restart), the time between the old process last known alive (its last report or
    heartbeat) and the new process's start is silent where no stored window covers it (windows the
    agent buffered through the outage cover the time they were held back), if that part is longer than
    two windows."""
    previous, alive_at = workload.flow_process_start_id, workload.flow_process_alive_at
    if not previous or previous == report.process_start_id or alive_at is None:
        return []
    started = now - timedelta(seconds=report.uptime_seconds)
    threshold = timedelta(seconds=2 * report.window_seconds)
    if started - alive_at <= threshold:
        return []
    covered = list(
        FlowWindow.objects.filter(workload=workload, end__gt=alive_at, start__lt=started).values_list(
            "start", "end"
        )
    )
    return [
        EvidenceGap(
            id=uuid.uuid4(),
            workload=workload,
            kind=GapKind.AGENT_SILENT,
            source=None,
            start=low,
            end=high,
            lost={},
            received_at=now,
        )  # fmt: skip
        for low, high in _uncovered(alive_at, started, covered)
        if high - low > threshold
    ]


def _rows_insert(model, rows: list[dict]) -> None:
    """The hot path of ingestion: COPY on PostgreSQL (no model instance per row, one round trip),
    bulk_create elsewhere. `rows` hold the model's column values by field attname."""
    if not rows:
        return
    if connection.vendor != "postgresql":
        model.objects.bulk_create([model(**row) for row in rows], batch_size=5000)
        return
    columns = list(rows[0])
    names = ", ".join(f'"{model._meta.get_field(column).column}"' for column in columns)
    with connection.cursor() as cursor:
        with cursor.cursor.copy(f'COPY "{model._meta.db_table}" ({names}) FROM STDIN') as copy:  # noqa: S608
            for row in rows:
                copy.write_row([row[c] for c in columns])


def _stored_days(now: datetime) -> tuple[date, date]:
    """The days evidence may lie on: back to the retention (older would be removed at once), and a
    year ahead (an agent's clock may be off, but not by years). Bounds the partitions a report makes."""
    today = now.astimezone(UTC).date()
    return today - timedelta(days=runtime.facts.retention_days), today + timedelta(days=366)


def _check_stored_day(instant: datetime, name: str, days: tuple[date, date]) -> None:
    if not days[0] <= instant.astimezone(UTC).date() <= days[1]:
        raise Refused(f"{name} lies outside the stored range: back to the retention, a year ahead")


def _report_days(report: Report, days: tuple[date, date], today: date) -> set[date]:
    """The days this report's rows fall on (windows by start, gaps by end, agent_silent today)."""
    found = {today}
    for items, key in ((report.windows, "start"), (report.gaps, "end")):
        for raw in items:
            instant = parse_instant(raw.get(key)) if isinstance(raw, dict) else None
            if instant is not None and days[0] <= instant.astimezone(UTC).date() <= days[1]:
                found.add(instant.astimezone(UTC).date())
    return found


HOUR_KEY = ("workload_id", "hour", "peer", "protocol", "port", "decision", "rule_number")
HOUR_SUMS = ("connection_count", "bytes_in", "bytes_out")
_LEAST = {"postgresql": ("LEAST", "GREATEST")}
HOUR_ROWS_PER_STATEMENT = 2000  # 13 parameters each: under SQLite's 32,766


def _hours_add(groups: list[dict]) -> None:
    """Add the report's groups to their hours' sums (FlowHour), one upsert per hour and key."""
    hours: dict[tuple, dict] = {}
    for group in groups:
        hour = group["start"].replace(minute=0, second=0, microsecond=0)
        key = (group["workload_id"], hour, group["peer"], group["protocol"], group["port"],
               group["decision"], group["rule_number"] or 0)  # fmt: skip
        row = hours.get(key)
        if row is None:
            hours[key] = {**dict(zip(HOUR_KEY, key, strict=True)), "peer_workload_id": group["peer_workload_id"],
                          **{name: group[name] for name in (*HOUR_SUMS, "first_seen", "last_seen")}}  # fmt: skip
            continue
        for name in HOUR_SUMS:
            row[name] += group[name]
        row["first_seen"] = min(row["first_seen"], group["first_seen"])
        row["last_seen"] = max(row["last_seen"], group["last_seen"])
    if not hours:
        return
    least, greatest = _LEAST.get(connection.vendor, ("min", "max"))
    table = FlowHour._meta.db_table
    columns = [*HOUR_KEY, "peer_workload_id", *HOUR_SUMS, "first_seen", "last_seen"]
    fields = [FlowHour._meta.get_field(name) for name in columns]
    updates = [f'"{name}" = "{table}"."{name}" + excluded."{name}"' for name in HOUR_SUMS] + [
        f'"first_seen" = {least}("{table}"."first_seen", excluded."first_seen")',
        f'"last_seen" = {greatest}("{table}"."last_seen", excluded."last_seen")',
        '"peer_workload_id" = excluded."peer_workload_id"',
    ]
    quoted = ", ".join(f'"{field.column}"' for field in fields)
    conflict = ", ".join(f'"{FlowHour._meta.get_field(name).column}"' for name in HOUR_KEY)
    upsert = f"ON CONFLICT ({conflict}) DO UPDATE SET {', '.join(updates)}"
    if connection.vendor == "postgresql":
        # One statement of one array per column: the same text for every report (planned once), no
        # per-value preparation; the report's keys are distinct, as ON CONFLICT needs.
        arrays = ", ".join(f"%s::{field.db_type(connection)}[]" for field in fields)
        with connection.cursor() as cursor:
            cursor.execute(
                f'INSERT INTO "{table}" ({quoted}) SELECT * FROM unnest({arrays}) {upsert}',  # noqa: S608
                [[row[name] for row in hours.values()] for name in columns],
            )
        return
    # SQLite: rows of values, prepared as its columns store them, in slices under its parameter cap.
    per_row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    rows = [
        [
            field.get_db_prep_value(row[name], connection, prepared=False)
            for field, name in zip(fields, columns, strict=True)
        ]
        for row in hours.values()
    ]
    with connection.cursor() as cursor:
        for at in range(0, len(rows), HOUR_ROWS_PER_STATEMENT):
            chunk = rows[at : at + HOUR_ROWS_PER_STATEMENT]
            cursor.execute(
                f'INSERT INTO "{table}" ({quoted}) VALUES {", ".join([per_row] * len(chunk))} {upsert}',  # noqa: S608
                [value for row in chunk for value in row],
            )


def flow_report_ingest(*, workload_id: str, data: Any) -> dict:
    """Store a report's windows and gaps; answer each with `accepted` or `refused` and the reason."""
    report = _envelope(data)
    days = _stored_days(clock.now())
    # Partitions are made before the report's transaction, each in its own short one: made inside it,
    # the DDL's lock on the parent table would be held to the end and could deadlock another report's.
    flow_partitions_ensure(days=_report_days(report, days, clock.now().astimezone(UTC).date()))
    with transaction.atomic():
        workload = workload_get(workload_id=workload_id, for_update=True)
        now = clock.now()
        peers = _peer_workloads()
        window_results, windows, groups = [], [], []
        parsed: list[tuple[Any, uuid.UUID | None, Any]] = []
        for raw in report.windows:
            try:
                window_id, start, end, body = _window(raw, window_seconds=report.window_seconds)
                _check_stored_day(start, "start", days)
                rows = [
                    _group(g, start=start, end=end, accounting=body["accounting"]) for g in body["groups"]
                ]
                parsed.append((raw, window_id, (start, end, body, rows)))
            except Refused as refused:
                parsed.append((raw, None, str(refused)))
        ids = [window_id for _, window_id, _ in parsed if window_id is not None]
        stored = dict(FlowWindow.objects.filter(id__in=ids).values_list("id", "workload_id"))
        for raw, window_id, outcome in parsed:
            if window_id is None:
                window_results.append(_result(raw, REFUSED, outcome))
                continue
            if window_id in stored:
                same = stored[window_id] == workload.id
                window_results.append(
                    _result(raw, ACCEPTED) if same else _result(raw, REFUSED, "id is taken")
                )
                continue
            start, end, body, rows = outcome
            stored[window_id] = workload.id  # a repeat within this report is stored once
            windows.append(
                {
                    "id": window_id,
                    "workload_id": workload.id,
                    "start": start,
                    "end": end,
                    "policy_version": body.get("policy_version", ""),
                    "accounting": body["accounting"],
                    "received_at": now,
                }
            )
            groups.extend(
                {
                    "window_id": window_id,
                    "workload_id": workload.id,
                    "start": start,
                    "end": end,
                    "peer_workload_id": peers.get(row["peer"]),
                    **row,
                }
                for row in rows
            )
            window_results.append(_result(raw, ACCEPTED))
        _rows_insert(FlowWindow, windows)
        _rows_insert(FlowGroup, groups)
        _hours_add(groups)

        gap_results, gaps = [], []
        gap_parsed = []
        for raw in report.gaps:
            try:
                gap_id, gap = _gap(raw)
                _check_stored_day(gap["end"], "end", days)
                gap_parsed.append((raw, gap_id, gap))
            except Refused as refused:
                gap_parsed.append((raw, None, str(refused)))
        stored_gaps = dict(
            EvidenceGap.objects.filter(id__in=[g[1] for g in gap_parsed if g[1] is not None]).values_list(
                "id", "workload_id"
            )
        )
        for raw, gap_id, outcome in gap_parsed:
            if gap_id is None:
                gap_results.append(_result(raw, REFUSED, outcome))
            elif gap_id in stored_gaps:
                same = stored_gaps[gap_id] == workload.id
                gap_results.append(_result(raw, ACCEPTED) if same else _result(raw, REFUSED, "id is taken"))
            else:
                stored_gaps[gap_id] = workload.id
                gaps.append(EvidenceGap(id=gap_id, workload=workload, received_at=now, **outcome))
                gap_results.append(_result(raw, ACCEPTED))
        silent = _agent_silent(workload, report, now)
        gaps.extend(silent)
        EvidenceGap.objects.bulk_create(gaps)
        Workload.objects.filter(id=workload.id).update(
            flow_process_start_id=report.process_start_id,
            flow_process_alive_at=now,
            last_flow_report_at=now,
            **_skew_fields(report, now),
            **_latest_gap_fields(workload, gaps),
        )
    return {"windows": window_results, "gaps": gap_results}


@dataclass(frozen=True)
class Pruned:
    rows: int  # windows and gaps deleted row by row
    partitions: int  # day partitions dropped whole, rows and all (PostgreSQL)


def flow_evidence_prune(*, older_than: timedelta) -> Pruned:
    """Remove windows (with their groups) and gaps that ended before `older_than` ago: whole day
    partitions on PostgreSQL, then the rows left in the partitions that straddle the cutoff."""
    cutoff = clock.now() - older_than
    partitions = flow_partitions_drop(before=cutoff)
    FlowGroup.objects.filter(end__lt=cutoff).delete()
    # An hour's windows start in it and end within the next: its sums go once both are past.
    FlowHour.objects.filter(hour__lt=cutoff - timedelta(hours=2)).delete()
    windows, _ = FlowWindow.objects.filter(end__lt=cutoff).delete()
    gaps, _ = EvidenceGap.objects.filter(end__lt=cutoff).delete()
    return Pruned(rows=windows + gaps, partitions=partitions)

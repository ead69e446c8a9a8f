"""Ingestion of an agent's flow report: validated per window and gap, stored once, acknowledged.

A malformed window or gap is refused with its reason (flows/reports.py) and the rest of the report
still lands; the agent drops what was refused (reporting a `window_rejected` gap for a refused window)
and never re-sends it. Ids are the agent's, so a re-send after a lost acknowledgement stores nothing
twice; reports of one workload are serialised on its row, so concurrent re-sends are safe too, from
one serve process or several.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import operator
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction

from controlplane import clock, metrics
from controlplane.outage import database_busy, database_unavailable
from controlplane.problems import Problem
from controlplane.sqlite import database_wait
from controlplane.webhooks.outbox import Event, webhook_events_record, workload_event
from fleet import health
from fleet.models import Workload, WorkloadReading, workload_from_row, workload_reading
from fleet.report_auth import ReportSender, report_sender_still_current
from fleet.selectors import workload_get
from flows.choices import AGGREGATE, GapKind
from flows.group_commit import GroupCommit
from flows.models import (
    EvidenceGap,
    FlowGroup,
    FlowWindow,
    UnsummedWindow,
)
from flows.partitions import flow_partitions_drop, flow_partitions_ensure
from flows.reports import (
    DIRECTION_VALUES,
    ID_TAKEN,
    Aggregated,
    ParsedReport,
    ParsedWindow,
    Refused,
    Report,
    item_answer,
    keys_fold_counted,
    report_parse,
)
from flows.sums.ladder import LADDER, UNSUMMED_PRUNE_MARGIN

log = logging.getLogger("palisade.flows")
_peer_map: tuple[tuple, dict[str, uuid.UUID], dict[str, bytes]] = ((), {}, {})


def _peer_workloads(stamp: tuple, *, as_bytes: bool) -> dict[str, uuid.UUID] | dict[str, bytes]:
    """Address -> workload for the whole fleet (its id, or with `as_bytes` its 16 bytes, as the groups'
    COPY sends it), rebuilt only when the fleet changed: addresses are set at enrolment and
    re-enrolment only, both of which set `enrolled_at` to now, and workloads are never deleted, so
    the latest enrolment (`stamp`, read off an index with the write's lock) says whether the map is
    current."""
    global _peer_map
    if stamp != _peer_map[0]:
        addresses = Workload.objects.values_list("id", "addresses")
        ids = {address: wid for wid, listed in addresses for address in listed}
        _peer_map = (stamp, ids, {address: wid.bytes for address, wid in ids.items()})
    return _peer_map[2] if as_bytes else _peer_map[1]


def _write_cursor():
    """The one cursor of a write's transaction, for all its statements: a Django cursor made for each
    statement cost more CPU than the statement's round trip. On PostgreSQL its parameters go apart from
    the statement (server-side binding): Django's own cursors quote every parameter into the statement's
    text in Python (the workloads' update quotes a dozen arrays). Still Django's cursor wrapper (its
    errors, its query log), over a plain psycopg cursor, with the time zone as Django's cursors have it."""
    if connection.vendor != "postgresql":
        return connection.cursor()
    from django.db.backends.postgresql.psycopg_any import register_tzloader
    from psycopg import Cursor
    from psycopg.pq import Format

    connection.ensure_connection()
    with connection.wrap_database_errors:
        cursor = Cursor(connection.connection)
    if (
        connection.timezone
        != connection.connection.adapters.get_loader(_TIMESTAMPTZ_OID, Format.TEXT).timezone
    ):
        register_tzloader(connection.timezone, cursor)
    return connection._prepare_cursor(cursor)


_TIMESTAMPTZ_OID = 1184


def _skew_fields(report: Report, now: datetime) -> dict:
    """Clock skew: the agent's clock off by more than two windows marks the workload; a report within
    the threshold clears it."""
    offset = (report.agent_clock - now).total_seconds()
    if health.clock_skewed(
        agent_clock=report.agent_clock, now=now, window=timedelta(seconds=report.window_seconds)
    ):
        return {"clock_skew_seconds": round(offset, 3), "clock_skew_seen_at": now}
    return {"clock_skew_seconds": None, "clock_skew_seen_at": None}


def _newer_fields(workload: Workload, report: Report, now: datetime) -> dict | None:
    """The workload's liveness, process and clock skew from a report newer than its latest
    (`health.report_is_news`), or None for one that is not (a replay, a re-send)."""
    current, earlier = workload.flow_process_start_id, workload.flow_processes_before.split("\n")
    if not health.report_is_news(
        process=report.process_start_id,
        uptime=report.uptime_seconds,
        latest_process=current,
        latest_uptime=workload.flow_process_uptime_seconds,
        earlier=earlier,
    ):
        return None
    earlier = health.processes_before(
        process=report.process_start_id, latest_process=current, earlier=earlier
    )
    return {
        "flow_window_seconds": report.window_seconds,
        "flow_process_start_id": report.process_start_id,
        "flow_process_uptime_seconds": report.uptime_seconds,
        "flow_processes_before": "\n".join(process for process in earlier if process),
        "flow_process_alive_at": now,
        "last_flow_report_at": now,
        **_skew_fields(report, now),
    }


def _latest_gap_fields(workload: Workload, gaps: list[EvidenceGap]) -> dict:
    if not gaps:
        return {}
    latest = max(gaps, key=lambda gap: gap.end)
    if workload.last_gap_end is not None and workload.last_gap_end >= latest.end:
        return {}
    return {"last_gap_kind": latest.kind, "last_gap_start": latest.start, "last_gap_end": latest.end}


def _agent_silent(
    workload: Workload, report: Report, now: datetime, *, arriving: list[tuple[datetime, datetime]]
) -> list[EvidenceGap]:
    """The spec's agent_silent (`health.agent_silent`), derived here and never taken from the agent:
    the silence before this report that neither the windows arriving with it nor stored ones cover."""

    def covered(since: datetime, started: datetime) -> list[tuple[datetime, datetime]]:
        return arriving + list(
            FlowWindow.objects.filter(workload=workload, end__gt=since, start__lt=started).values_list(
                "start", "end"
            )
        )

    silences = health.agent_silent(
        latest_process=workload.flow_process_start_id,
        alive_at=workload.flow_process_alive_at,
        latest_window=timedelta(seconds=workload.flow_window_seconds or report.window_seconds),
        process=report.process_start_id,
        started=now - timedelta(seconds=report.uptime_seconds),
        window=timedelta(seconds=report.window_seconds),
        covered=covered,
    )
    return [
        EvidenceGap(
            id=uuid.uuid4(),
            workload_id=workload.id,
            kind=GapKind.AGENT_SILENT,
            source=None,
            start=low,
            end=high,
            lost={},
            received_at=now,
        )  # fmt: skip
        for low, high in silences
    ]


def _rows_insert(cursor, model, rows: list[dict]) -> None:
    """`_values_insert` of rows that hold the model's column values by field attname."""
    if rows:
        columns = tuple(rows[0])
        _values_insert(cursor, model, columns, [[row[c] for c in columns] for row in rows])


def _values_insert(
    cursor, model, columns: tuple[str, ...], rows: list[list], *, uuids_as_bytes: bool = False
) -> None:
    """The hot path of ingestion: binary COPY on PostgreSQL (no model instance per row, one round trip;
    3,200 group rows cost 6 ms of CPU to send where text COPY cost 46), one prepared INSERT run over
    every row on SQLite. `rows` hold the values of `columns` (field attnames), in that order; with
    `uuids_as_bytes` a UUID column's values on PostgreSQL are its 16 bytes (`UUID.bytes`), which is
    the uuid's binary form: COPY sends them as they are (as bytea's, whose dumper is psycopg's C)."""
    if not rows:
        return
    if connection.vendor != "postgresql":
        _rows_insert_in_sqlite(cursor, model, columns, rows)
        return
    sql, types = _copy_statement(model, columns, uuids_as_bytes)
    with cursor.cursor.copy(sql) as copy:
        copy.set_types(types)
        write = copy.write_row
        for row in rows:
            write(row)


@functools.lru_cache(maxsize=32)
def _copy_statement(model, columns: tuple[str, ...], uuids_as_bytes: bool) -> tuple[str, list[int]]:
    """A table's binary COPY and its columns' type OIDs (named, each lookup cost more than the row)."""
    from psycopg import adapters

    fields = [model._meta.get_field(column) for column in columns]
    names = ", ".join(f'"{field.column}"' for field in fields)
    sql = f'COPY "{model._meta.db_table}" ({names}) FROM STDIN (FORMAT BINARY)'  # noqa: S608
    types = [_binary_copy_type(field) for field in fields]
    if uuids_as_bytes:
        # The values go out in binary COPY as given: bytea's binary form is the bytes themselves.
        types = ["bytea" if kind == "uuid" else kind for kind in types]
    return sql, [adapters.types[kind].oid for kind in types]


def _rows_insert_in_sqlite(cursor, model, columns: tuple[str, ...], rows: list[list]) -> None:
    """SQLite holds its one write lock for the whole transaction: the rows go in as one `executemany`
    of values prepared as the columns store them (80,000 groups: 0.6 s, where bulk_create's model
    instances and SQL building held the lock for 8 s)."""
    fields = [model._meta.get_field(column) for column in columns]
    prepare = [_sqlite_value(field) for field in fields]
    names = ", ".join(f'"{field.column}"' for field in fields)
    sql = f'INSERT INTO "{model._meta.db_table}" ({names}) VALUES ({", ".join(["%s"] * len(fields))})'  # noqa: S608
    values = [tuple(p(value) if p else value for p, value in zip(prepare, row, strict=True)) for row in rows]
    cursor.executemany(sql, values)


def _sqlite_value(field):
    """How a column's value is stored in SQLite, where Django's own conversion differs from the value:
    UUIDs as 32 hex digits, instants as UTC text (a window's rows share a few, converted once each)."""
    kind = (field.target_field if field.is_relation else field).get_internal_type()
    if kind == "UUIDField":
        return lambda value: None if value is None else value.hex
    if kind == "DateTimeField":
        return functools.lru_cache(maxsize=4096)(connection.ops.adapt_datetimefield_value)
    return None


# Binary COPY sends each value in its column's own wire format, so the type is named up front.
_BINARY_COPY_TYPES = {
    "UUIDField": "uuid",
    "DateTimeField": "timestamptz",
    "CharField": "text",  # varchar's wire format is text's; the column still checks its length
    "BooleanField": "bool",
    "IntegerField": "int4",
    "PositiveIntegerField": "int4",
    "BigIntegerField": "int8",
    "PositiveBigIntegerField": "int8",
    "BigAutoField": "int8",
}


def _binary_copy_type(field) -> str:
    return _BINARY_COPY_TYPES[(field.target_field if field.is_relation else field).get_internal_type()]


def _webhook_events(workload: Workload, changes: dict, new_gaps: list[EvidenceGap]) -> list[Event]:
    """An evidence gap recorded (each new one), and clock skew detected (it was not skewed before)."""
    events = [
        workload_event(
            "workload.evidence_gap",
            workload,
            gap={
                "id": str(gap.id),
                "kind": gap.kind,
                "source": gap.source,
                "start": clock.rfc3339(gap.start),
                "end": clock.rfc3339(gap.end),
                "lost": gap.lost,
            },
        )
        for gap in new_gaps
    ]
    skew = changes.get("clock_skew_seconds")
    if skew is not None and workload.clock_skew_seconds is None:
        events.append(workload_event("workload.clock_skew", workload, offset_seconds=skew))
    return events


WORKLOAD_FLOW_FIELDS = (
    "flow_window_seconds_longest",
    "flow_window_seconds",
    "flow_process_start_id",
    "flow_process_uptime_seconds",
    "flow_processes_before",
    "flow_process_alive_at",
    "last_flow_report_at",
    "clock_skew_seconds",
    "clock_skew_seen_at",
    "last_gap_kind",
    "last_gap_start",
    "last_gap_end",
)


def _windows_and_workloads_write(
    cursor, windows: list[dict], unsummed: list[dict], workloads: list[Workload]
) -> None:
    """The windows' rows, their unsummed marks (`_unsummed_row`) and the workloads' flow fields. On
    PostgreSQL in one statement (two INSERTs in a WITH, then the UPDATE): as two COPYs and an UPDATE
    they were three round trips and seven waits for the server, and each wait cost more of serve's CPU
    than these few rows. The groups, fifty a window, stay a COPY of their own.

    Each part's rows go as one JSON parameter, read back by `json_to_recordset` into the columns'
    own types: as a column array each (two dozen arrays), psycopg's list adaptation, in Python, cost
    150 us of serve's CPU a write, the JSON 60."""
    if connection.vendor != "postgresql":
        _rows_insert(cursor, FlowWindow, windows)
        _rows_insert(cursor, UnsummedWindow, unsummed)
        _workloads_update(cursor, workloads)
        return
    if not workloads:  # nothing of this write's was stored
        return
    sql, attnames = _windows_and_workloads_statement()
    cursor.execute(
        sql,
        [
            _json_rows(windows),
            _json_rows(unsummed),
            _json_rows([{name: getattr(workload, name) for name in attnames} for workload in workloads]),
        ],
    )


WINDOW_COLUMNS = ("id", "workload_id", "start", "end", "policy_version", "accounting", "received_at")
UNSUMMED_COLUMNS = ("window_id", "workload_id", "start", "keys")


def _json_rows(rows: list[dict]) -> str:
    """Rows as `json_to_recordset` reads them: ids as their text, instants in ISO 8601 with their
    offset (PostgreSQL reads both exactly), numbers as JSON's (a float's shortest repr, read back
    exactly); NaN and the infinities are refused, not written as JSON that is not JSON."""
    return json.dumps(rows, default=_json_value, allow_nan=False, separators=(",", ":"))


def _json_value(value: Any) -> str:
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime):
        if value.tzinfo is None:  # never: every instant here is aware; a naive one is not guessed at
            raise TypeError(f"a naive datetime in a flow write: {value!r}")
        return value.isoformat()
    raise TypeError(f"no JSON form for {type(value).__name__} in a flow write")


def _json_records(model, names: tuple[str, ...]) -> tuple[list, str, str]:
    """The fields of `names` (attnames), their columns, and `json_to_recordset`'s column list (each
    attname with its column's type)."""
    fields = [model._meta.get_field(name) for name in names]
    columns = ", ".join(f'"{field.column}"' for field in fields)
    record = ", ".join(f'"{field.attname}" {field.db_type(connection)}' for field in fields)
    return fields, columns, record


@functools.cache
def _windows_and_workloads_statement() -> tuple[str, list[str]]:
    """PostgreSQL's statement of `_windows_and_workloads_write`, and the workloads' attributes it
    reads, in order (its parameters: the windows', the marks' and the workloads' rows as JSON)."""

    def json_insert(model, names: tuple[str, ...]) -> str:
        fields, columns, record = _json_records(model, names)
        values = ", ".join(f'r."{field.attname}"' for field in fields)
        table = model._meta.db_table
        return f'INSERT INTO "{table}" ({columns}) SELECT {values} FROM json_to_recordset(%s::json) AS r({record})'  # noqa: S608

    names = ("id", *WORKLOAD_FLOW_FIELDS)
    fields, _, record = _json_records(Workload, names)
    assignments = ", ".join(f'"{field.column}" = u."{field.attname}"' for field in fields[1:])
    table = Workload._meta.db_table
    update = (
        f'UPDATE "{table}" SET {assignments} FROM json_to_recordset(%s::json) AS u({record}) '  # noqa: S608 - our names
        f'WHERE "{table}"."id" = u."id"'
    )
    windows, marks = json_insert(FlowWindow, WINDOW_COLUMNS), json_insert(UnsummedWindow, UNSUMMED_COLUMNS)
    return f"WITH windows AS ({windows}), marks AS ({marks}) {update}", [field.attname for field in fields]


def _workloads_update(cursor, workloads: list[Workload]) -> None:
    """Write the flow fields of the reporting workloads (their rows are locked), one statement per
    workload (SQLite; PostgreSQL's is part of `_windows_and_workloads_write`'s statement)."""
    for workload in workloads:
        Workload.objects.filter(id=workload.id).update(
            **{name: getattr(workload, name) for name in WORKLOAD_FLOW_FIELDS}
        )


@dataclass(frozen=True)
class SubmittedReport:
    workload_id: uuid.UUID
    report: ParsedReport
    sender: ReportSender | None = None  # checked again when the report is written


def flow_report_ingest(*, workload_id: str, data: Any, sender: ReportSender | None = None) -> dict:
    """Store a report's windows and gaps; answer each with `accepted` or `refused` and the reason.

    Reports that arrive together on serve's threads are written together, in one transaction
    (group commit); a caller already inside a transaction writes its report alone, in it. With
    `sender` (the gateway's), the report is refused whole if its credential is no longer the
    workload's current one when its workload's row is locked for the write."""
    report = report_parse(data, now=clock.now())
    try:
        submitted = SubmittedReport(uuid.UUID(str(workload_id)), report, sender)
    except ValueError:
        workload_get(workload_id=workload_id)  # raises the not-found problem
        raise
    # Partitions are made before the report's transaction, each in its own short one: made inside it,
    # the DDL's lock on the parent table would be held to the end and could deadlock another report's.
    flow_partitions_ensure(days=report.days)
    if connection.in_atomic_block:
        outcome = flow_reports_write([submitted])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    # On SQLite a report waits a short while for its turn to write, then is answered 503 with
    # Retry-After (the agent sends it again): behind a long write it neither waits its whole length
    # nor holds a thread for it.
    with database_wait(settings.PALISADE_SQLITE_REPORT_WAIT_SECONDS):
        return _group_commit.submit(submitted)


def flow_reports_write(items: list[SubmittedReport]) -> list[dict | Exception]:
    """Store the reports of distinct workloads in one transaction: one lock statement for their rows,
    one of the reads (`_stored_reads`), the groups' COPY, the gaps, and one statement of the windows
    and the workloads' update (`_windows_and_workloads_write`). Their quarters, hours and
    blocks are summed later (`flow_windows_sum`). Returns each report's answer, or the problem that
    refused it.

    The batch never waits for a workload's row: one that another transaction holds (a re-render, a
    mode change, another serve process's write) is skipped, and its report written alone afterwards,
    waiting then for that one row. Waiting while holding the batch's other rows could close a cycle
    with a transaction that locks the same rows in another order (a deadlock, one of them aborted)."""
    batch = _reports_write(items, skip_locked=len(items) > 1)
    return [
        _reports_write([item], skip_locked=False)[0] if outcome is None else outcome
        for item, outcome in zip(items, batch, strict=True)
    ]


def _reports_write(items: list[SubmittedReport], *, skip_locked: bool) -> list[dict | Exception | None]:
    """`flow_reports_write` for one transaction; None for a report whose workload row was skipped."""
    with transaction.atomic(), _write_cursor() as cursor:
        locked, stamp = _workloads_lock(cursor, [item.workload_id for item in items], skip_locked=skip_locked)
        now = clock.now()
        # Nothing is written without a locked workload: the fleet's addresses are read only with one.
        # On PostgreSQL the groups' ids go to COPY as their 16 bytes (`_values_insert`), made once a
        # window and once a peer: UUID's own conversion, a Python call per value, cost a tenth of the
        # parse of a report.
        as_bytes = connection.vendor == "postgresql"
        peers = _peer_workloads(stamp, as_bytes=as_bytes) if locked else {}
        stored_windows, stored_gaps, kept = _stored_reads(
            cursor,
            windows=[w.id for item in items for _, w in item.report.windows if isinstance(w, ParsedWindow)],
            gaps=[g[0] for item in items for _, g in item.report.gaps if not isinstance(g, Refused)],
            starts=[
                (i.workload_id, w.start)
                for i in items
                for _, w in i.report.windows
                if isinstance(w, ParsedWindow)
            ],
        )
        outcomes: list[dict | Exception | None] = []
        counted = metrics.FlowItemsCounted()
        windows: list[dict] = []
        parsed: list[ParsedWindow] = []  # beside `windows`, row for row
        groups: list[list] = []  # values of GROUP_COLUMNS
        gaps: list[EvidenceGap] = []
        touched: list[Workload] = []
        events: list[Event] = []
        for item in items:
            workload = locked.get(item.workload_id)
            if workload is None:
                outcomes.append(
                    None if skip_locked else Problem("not-found", f"No workload {item.workload_id}.")
                )
                continue
            refusal = (
                None
                if item.sender is None
                else report_sender_still_current(
                    item.sender,
                    public_key=workload.public_key,
                    credential_serial=workload.credential_serial,
                    credential_expires_at=workload.credential_expires_at,
                    credential_revoked_at=workload.credential_revoked_at,
                    now=now,
                )
            )
            if refusal is not None:
                outcomes.append(refusal)
                continue
            window_answers, new_windows = [], []
            for raw, window in item.report.windows:
                refused = window if isinstance(window, Refused) else None
                new = False
                if refused is None:
                    new, refused = _stored_once(window.id, stored_windows, workload.id)
                window_answers.append(item_answer(raw, refused))
                if refused is not None:
                    counted.window_refused(refused.code, raw)
                elif new:
                    new_windows.append(_within_start_bound(window, workload_id=workload.id, kept=kept))
                else:
                    counted.resent += 1
            gap_answers, new_gaps = [], []
            for raw, gap in item.report.gaps:
                refused = gap if isinstance(gap, Refused) else None
                new = False
                if refused is None:
                    gap_id, fields = gap
                    new, refused = _stored_once(gap_id, stored_gaps, workload.id)
                gap_answers.append(item_answer(raw, refused))
                if refused is not None:
                    counted.gaps_refused[refused.code] += 1
                elif new:
                    new_gaps.append(
                        EvidenceGap(id=gap_id, workload_id=workload.id, received_at=now, **fields)
                    )
            new_gaps.extend(_keys_aggregated(new_windows, workload=workload, now=now))
            newer = _newer_fields(workload, item.report.envelope, now)
            if newer is not None:
                new_gaps.extend(
                    _agent_silent(
                        workload, item.report.envelope, now, arriving=[(w.start, w.end) for w in new_windows]
                    )
                )
            windows.extend(_window_row(window, workload=workload, now=now) for window in new_windows)
            parsed.extend(new_windows)
            groups.extend(_group_rows(new_windows, workload=workload, peers=peers, as_bytes=as_bytes))
            gaps.extend(new_gaps)
            changes = {
                "flow_window_seconds_longest": max(
                    workload.flow_window_seconds_longest, item.report.envelope.window_seconds
                ),
                **(newer or {}),
                **_latest_gap_fields(workload, new_gaps),
            }
            events.extend(_webhook_events(workload, changes, new_gaps))
            for name, value in changes.items():
                setattr(workload, name, value)
            touched.append(workload)
            counted.reports += 1
            outcomes.append({"windows": window_answers, "gaps": gap_answers})
        _values_insert(cursor, FlowGroup, GROUP_COLUMNS, groups, uuids_as_bytes=True)
        EvidenceGap.objects.bulk_create(gaps)
        _windows_and_workloads_write(
            cursor,
            windows,
            [_unsummed_row(row, len(window.groups)) for row, window in zip(windows, parsed, strict=True)],
            touched,
        )
        counted.windows, counted.groups = len(windows), len(groups)
        metrics.flow_reports_stored(counted, gaps=gaps)
        webhook_events_record(events)
    return outcomes


# A write's reads are a handful of small statements over a few rows each: written out in SQL, they cost
# a third of the CPU the ORM spent building them, and serve writes hundreds of reports a second.


def _workloads_lock(
    cursor, ids: list[uuid.UUID], *, skip_locked: bool
) -> tuple[dict[uuid.UUID, Workload], tuple]:
    """The reporting workloads' rows, locked (PostgreSQL) in one order for every writer, with the flow
    fields a write reads and updates only; and the fleet's latest enrolment (`_peer_workloads`), read
    in the same statement (one round trip and one statement's CPU less a write)."""
    if not ids:
        return {}, ()
    sql, reading = _workloads_lock_statement(connection.vendor, len(ids), skip_locked)
    pk = Workload._meta.pk
    cursor.execute(sql, [pk.get_db_prep_value(i, connection) for i in ids])
    rows = cursor.fetchall()
    # Model instances made as the ORM makes them, without building a query for them: that cost more
    # than the statement (a RawQuerySet's column mapping and converters, found again every time).
    locked = {}
    for row in rows:
        workload = workload_from_row(reading, row[:-1])
        locked[workload.id] = workload
    return locked, (rows[0][-1],) if rows else ()


# hostname and labels name the workload in webhook events (no deferred load per workload); the
# credential's fields judge the report's sender again
_LOCKED_FIELDS = (
    "id",
    "hostname",
    "labels",
    "public_key",
    "credential_serial",
    "credential_expires_at",
    "credential_revoked_at",
    *WORKLOAD_FLOW_FIELDS,
)


@functools.lru_cache(maxsize=256)
def _workloads_lock_statement(vendor: str, count: int, skip_locked: bool) -> tuple[str, WorkloadReading]:
    """`_workloads_lock`'s statement for `count` rows, and how its rows become instances."""
    reading = workload_reading(vendor, _LOCKED_FIELDS)
    lock = (
        connection.ops.for_update_sql(skip_locked=skip_locked)
        if connection.features.has_select_for_update
        else ""
    )
    table = Workload._meta.db_table
    sql = (
        f'SELECT {reading.columns}, (SELECT max("enrolled_at") FROM "{table}") FROM "{table}" '  # noqa: S608
        f'WHERE "id" IN ({", ".join(["%s"] * count)}) ORDER BY "id" {lock}'
    )
    return sql, reading


def _stored_reads(
    cursor,
    *,
    windows: list[uuid.UUID],
    gaps: list[uuid.UUID],
    starts: list[tuple[uuid.UUID, datetime]],
) -> tuple[
    dict[uuid.UUID, uuid.UUID], dict[uuid.UUID, uuid.UUID], dict[tuple[uuid.UUID, datetime, str], int]
]:
    """What a write reads of what is stored, in one statement (each part of it is one read off an
    index; a statement apiece cost more CPU than the reads): stored id -> its workload's id for the
    windows' and the gaps' ids stored already, and the keys stored one by one for each (workload,
    window start) of `starts`, per direction (`_within_start_bound`)."""
    parts, params = [], []
    if starts:  # first: SQLite converts a compound select's columns by its first select's types
        sql, values = _keys_kept_query(starts)
        parts.append(f"SELECT 'k', {sql}")
        params += values
    for tag, model, ids in (("w", FlowWindow, windows), ("g", EvidenceGap, gaps)):
        if ids:
            sql, values = _owners_query(model, ids)
            parts.append(f"SELECT '{tag}', {sql}")
            params += values
    owners: dict[str, dict] = {"w": {}, "g": {}}
    kept: dict[tuple[uuid.UUID, datetime, str], int] = {}
    if not parts:
        return owners["w"], owners["g"], kept
    cursor.execute(" UNION ALL ".join(parts), params)
    pks = {"w": FlowWindow._meta.pk, "g": EvidenceGap._meta.pk}
    workload = FlowGroup._meta.get_field("workload").target_field
    for tag, item, owner, start, direction, keys in cursor.fetchall():
        if tag == "k":
            # SQLite gives the workload as its text and the start without its zone (UTC): read back as stored.
            kept[
                (workload.to_python(owner), start if start.tzinfo else start.replace(tzinfo=UTC), direction)
            ] = keys
        else:
            owners[tag][pks[tag].to_python(item)] = workload.to_python(owner)
    return owners["w"], owners["g"], kept


def _owners_query(model, ids: list[uuid.UUID]) -> tuple[str, list]:
    """The columns and FROM of a read of `ids`' owners: stored id, its workload, three blanks."""
    pk, owner = model._meta.pk, model._meta.get_field("workload")
    sql = (
        f'"id", "{owner.column}", NULL, NULL, NULL FROM "{model._meta.db_table}" '  # noqa: S608 - our names
        f'WHERE "id" IN ({", ".join(["%s"] * len(ids))})'
    )
    return sql, [pk.get_db_prep_value(i, connection) for i in ids]


def _stored_once(item_id: uuid.UUID, stored: dict, workload_id: uuid.UUID) -> tuple[bool, Refused | None]:
    """Whether to store a window or gap, or why it is refused: an id already stored for this workload
    is a re-send (acknowledged again, stored once), an id stored for another workload is refused."""
    owner = stored.get(item_id)
    if owner is None:
        stored[item_id] = workload_id  # a repeat later in this write is a re-send
        return True, None
    if owner == workload_id:
        return False, None
    return False, Refused("id is taken", ID_TAKEN)


def _window_row(window: ParsedWindow, *, workload: Workload, now: datetime) -> dict:  # WINDOW_COLUMNS
    return {
        "id": window.id,
        "workload_id": workload.id,
        "start": window.start,
        "end": window.end,
        "policy_version": window.policy_version,
        "accounting": window.accounting,
        "received_at": now,
    }


def _unsummed_row(window: dict, keys: int) -> dict:  # UNSUMMED_COLUMNS
    return {
        "window_id": window["id"],
        "workload_id": window["workload_id"],
        "start": window["start"],
        "keys": keys,
    }


def _keys_kept_query(pairs: list[tuple[uuid.UUID, datetime]]) -> tuple[str, list]:
    """The columns and FROM of the read of the keys kept by start: a blank, the workload, the start,
    the direction and the count, off the (workload, start) index."""
    workload, start = FlowGroup._meta.get_field("workload").target_field, FlowGroup._meta.get_field("start")
    workloads = [workload.get_db_prep_value(w, connection) for w in {w for w, _ in pairs}]
    starts = [start.get_db_prep_value(s, connection) for s in {s for _, s in pairs}]
    sql = (
        f'NULL, "workload_id", "start", "direction", count(*) FROM "{FlowGroup._meta.db_table}"'  # noqa: S608 - our names
        f' WHERE "workload_id" IN ({", ".join(["%s"] * len(workloads))})'
        f' AND "start" IN ({", ".join(["%s"] * len(starts))}) AND "peer" <> %s GROUP BY "workload_id", "start", "direction"'
    )
    return sql, [*workloads, *starts, AGGREGATE]


def _within_start_bound(window: ParsedWindow, *, workload_id: uuid.UUID, kept: dict) -> ParsedWindow:
    """The window with at most what is left of PALISADE_FLOW_WINDOW_MAX_KEYS in each direction for its
    workload and start kept one by one, the rest summed into its aggregate keys: the bound of a window
    holds for all of a workload's windows of one start, so that windows sent again under new ids (or by
    a restarted process for the same minute) add no keys past it. `kept` counts what this write keeps
    too."""
    room = {
        direction: max(
            settings.PALISADE_FLOW_WINDOW_MAX_KEYS - kept.get((workload_id, window.start, direction), 0), 0
        )
        for direction in DIRECTION_VALUES
    }
    groups, summed, counts = keys_fold_counted(window.groups, keep=room)
    for direction, keys in counts.items():
        at = (workload_id, window.start, direction)
        kept[at] = kept.get(at, 0) + keys
    if summed is None:
        return window
    if window.aggregated is not None:
        summed = Aggregated(
            summed.keys + window.aggregated.keys, summed.connections + window.aggregated.connections
        )
    return dataclasses.replace(window, groups=groups, aggregated=summed)


def _keys_aggregated(windows: list[ParsedWindow], *, workload: Workload, now: datetime) -> list[EvidenceGap]:
    """The `keys_aggregated` gap of each new window whose keys over the bound were summed here: its
    range, and how many keys and connections went into its aggregate keys. Written with the window
    (a re-sent window is not new, so its gap is written once)."""
    return [
        EvidenceGap(
            id=uuid.uuid4(),
            workload_id=workload.id,
            kind=GapKind.KEYS_AGGREGATED,
            source=None,
            start=window.start,
            end=window.end,
            lost={"keys": window.aggregated.keys, "connections": window.aggregated.connections},
            received_at=now,
        )
        for window in windows
        if window.aggregated is not None
    ]


# A group row's columns: its window's, then the key's as flows/reports.py parses them.
GROUP_KEY_FIELDS = (
    "peer",
    "protocol",
    "port",
    "decision",
    "rule_number",
    "direction",
    "failsafe",
    "connection_count",
    "first_seen",
    "last_seen",
    "bytes_in",
    "bytes_out",
)
GROUP_COLUMNS = ("window_id", "workload_id", "start", "end", "peer_workload_id", *GROUP_KEY_FIELDS)
_group_key_values = operator.itemgetter(*GROUP_KEY_FIELDS)


def _group_rows(
    windows: list[ParsedWindow], *, workload: Workload, peers: dict, as_bytes: bool
) -> list[list]:
    """The values of GROUP_COLUMNS for each group of `windows` (lists: one dict a row, then a list
    made from it for COPY, cost more than the COPY); with `as_bytes`, ids as their 16 bytes (`peers`
    holds them so too: `_peer_workloads`)."""
    peer_of = peers.get
    workload_id = workload.id.bytes if as_bytes else workload.id
    rows = []
    for window in windows:
        window_id, start, end = window.id.bytes if as_bytes else window.id, window.start, window.end
        rows += [
            [window_id, workload_id, start, end, peer_of(group["peer"]), *_group_key_values(group)]
            for group in window.groups
        ]
    return rows


def _stored_keys(item: SubmittedReport) -> int:
    return sum(len(window.groups) for _, window in item.report.windows if isinstance(window, ParsedWindow))


# Sized so a write stays short (a few hundred ms at most) while still taking the whole backlog of a
# busy second: 64 reports, and past the first no more keys in all than one report may store (20,000
# groups: about 0.15 s on SQLite, whose one writer everyone else waits for). A workload's reports are
# never in one write together. The database away or busy fails the whole write, not each report alone.
_group_commit = GroupCommit(
    flow_reports_write,
    key=lambda item: item.workload_id,
    most=64,
    weight=_stored_keys,
    most_weight=settings.PALISADE_FLOW_REPORT_MAX_KEYS,
    shared_failure=lambda error: database_busy(error) or database_unavailable(error),
)


@dataclass(frozen=True)
class Pruned:
    rows: int  # windows and gaps deleted row by row
    partitions: int  # day partitions dropped whole, rows and all (PostgreSQL)


def flow_evidence_prune(*, older_than: timedelta) -> Pruned:
    """Remove windows (with their groups) and gaps that ended before `older_than` ago: whole day
    partitions on PostgreSQL, then the rows left in the partitions that straddle the cutoff."""
    cutoff = clock.now() - older_than
    partitions = flow_partitions_drop(before=cutoff)
    _deleted(FlowGroup.objects.filter(end__lt=cutoff))
    for rung in LADDER:  # each past its own margin (flows.sums.ladder.Span.prune_margin)
        _deleted(rung.model.objects.filter(**{f"{rung.column}__lt": cutoff - rung.prune_margin}))
    _deleted(UnsummedWindow.objects.filter(start__lt=cutoff - UNSUMMED_PRUNE_MARGIN))
    windows = _deleted(FlowWindow.objects.filter(end__lt=cutoff))
    gaps = _deleted(EvidenceGap.objects.filter(end__lt=cutoff))
    return Pruned(rows=windows + gaps, partitions=partitions)


PRUNE_ROWS_PER_STATEMENT = 10_000


def _deleted(rows) -> int:
    """Delete `rows`, and say how many: at once on PostgreSQL (whose day partitions went whole before);
    on SQLite PRUNE_ROWS_PER_STATEMENT at a time, each its own short write, since an hour of a busy
    fleet's groups in one DELETE would hold its one writer, and every other, for seconds."""
    if connection.vendor == "postgresql":
        return rows.delete()[0]
    deleted = 0
    while ids := list(rows.values_list("pk", flat=True)[:PRUNE_ROWS_PER_STATEMENT]):
        deleted += rows.model.objects.filter(pk__in=ids).delete()[0]
    return deleted

"""The writes of the sums: the groups of stored windows added to their quarters', hours' and blocks'
rows (every span of the ladder, flows/sums/ladder.py), once each, by serve's housekeeping."""

from __future__ import annotations

import logging
import uuid
from datetime import datetime

from django.db import DataError, connection, transaction

from flows.models import FlowGroup, UnsummedWindow
from flows.sums.ladder import LADDER, SUMMED, Span, rule_stored, rule_stored_sql

log = logging.getLogger("palisade.flows")


SUM_ROWS_PER_STATEMENT = 2000  # 13 parameters each: under SQLite's 32,766


def _upsert_clause(sums: Span, least: str, greatest: str) -> str:
    table = sums.model._meta.db_table
    updates = [f'"{name}" = "{table}"."{name}" + excluded."{name}"' for name in SUMMED] + [
        f'"first_seen" = {least}("{table}"."first_seen", excluded."first_seen")',
        f'"last_seen" = {greatest}("{table}"."last_seen", excluded."last_seen")',
        '"peer_workload_id" = excluded."peer_workload_id"',
    ]
    conflict = ", ".join(f'"{name}"' for name in sums.key())
    return f"ON CONFLICT ({conflict}) DO UPDATE SET {', '.join(updates)}"


WINDOWS_PER_SUM = 5000  # a transaction of about 250,000 group rows at 50 keys a window


def flow_windows_sum(*, before: datetime, most: int = WINDOWS_PER_SUM) -> int:
    """Add the groups of the stored windows that started before `before` and are not summed yet to
    their quarters', hours' and blocks' sums; returns how many windows. Each batch of `most` windows
    is one transaction that removes the windows from UnsummedWindow and adds their groups, so a window
    is summed exactly once, into each, even with two serve processes at it (each skips the rows the
    other holds).

    A batch whose sums would leave their columns' range (a workload's flood of windows, or counts an
    older version accepted) is summed in halves, down to the windows that cannot be added: those stay
    unsummed, read from their minute rows by every rollup, and are tried again on the next round. One
    workload's counts never stop the fleet's sums."""
    summed, left_out = 0, set()
    while True:
        taken: list[tuple[uuid.UUID, uuid.UUID, datetime]] = []
        try:
            with transaction.atomic():
                taken = list(
                    UnsummedWindow.objects.filter(start__lt=before)
                    .exclude(window_id__in=left_out)
                    .order_by("workload_id", "start")
                    .select_for_update(skip_locked=True)
                    .values_list("window_id", "workload_id", "start")[:most]
                )
                if not taken:
                    return summed
                UnsummedWindow.objects.filter(window_id__in=[window_id for window_id, _, _ in taken]).delete()
                _sums_add(taken)
            summed += len(taken)
        except OUT_OF_RANGE:
            if not taken:
                raise
            done, out = _windows_sum_in_halves(taken)
            summed, left_out = summed + done, left_out | out


# PostgreSQL's "bigint out of range"; on SQLite, a Python int beyond its 64-bit integers.
OUT_OF_RANGE = (DataError, OverflowError)


def _windows_sum_or_halves(taken: list[tuple[uuid.UUID, uuid.UUID, datetime]]) -> tuple[int, set[uuid.UUID]]:
    """Sum `taken` in one transaction, else each half so; returns how many windows were summed and the
    ids of those that cannot be. Each is locked again: another summer may have had it since."""
    try:
        with transaction.atomic():
            locked = set(
                UnsummedWindow.objects.filter(window_id__in=[window_id for window_id, _, _ in taken])
                .select_for_update(skip_locked=True)
                .values_list("window_id", flat=True)
            )
            mine = [window for window in taken if window[0] in locked]
            if mine:
                UnsummedWindow.objects.filter(window_id__in=locked).delete()
                _sums_add(mine)
            return len(mine), set()
    except OUT_OF_RANGE as error:
        if len(taken) == 1:
            log.warning("cannot sum flow window %s (%s): rollups read its minute rows", taken[0][0], error)
            return 0, {taken[0][0]}
    return _windows_sum_in_halves(taken)


def _windows_sum_in_halves(taken: list[tuple[uuid.UUID, uuid.UUID, datetime]]) -> tuple[int, set[uuid.UUID]]:
    first = _windows_sum_or_halves(taken[: len(taken) // 2])
    second = _windows_sum_or_halves(taken[len(taken) // 2 :])
    return first[0] + second[0], first[1] | second[1]


def _sums_add(windows: list[tuple[uuid.UUID, uuid.UUID, datetime]]) -> None:
    """Add the groups of `windows` (id, workload id, start) to their quarters', hours' and blocks'
    sums, one upsert per workload, span and key. On PostgreSQL the database sums the groups where they
    lie; elsewhere Python does."""
    if connection.vendor == "postgresql":
        for sums in LADDER:
            _sums_add_in_postgresql(sums, windows)
        return
    groups = list(
        FlowGroup.objects.filter(window_id__in=[window_id for window_id, _, _ in windows]).values(
            "workload_id", "start", "peer", "protocol", "port", "decision", "rule_number", "peer_workload_id",
            *SUMMED, "first_seen", "last_seen",
        )
    )  # fmt: skip
    for sums in LADDER:
        _sums_write(sums, _summed_in_python(sums, groups))


def _summed_in_python(sums: Span, groups: list[dict]) -> list[dict]:
    rows: dict[tuple, dict] = {}
    for group in groups:
        key = (group["workload_id"], sums.start_of(group["start"]), group["peer"], group["protocol"],
               group["port"], group["decision"], rule_stored(group["rule_number"]))  # fmt: skip
        row = rows.get(key)
        if row is None:
            rows[key] = {**dict(zip(sums.key(), key, strict=True)), "peer_workload_id": group["peer_workload_id"],
                         **{name: group[name] for name in (*SUMMED, "first_seen", "last_seen")}}  # fmt: skip
            continue
        for name in SUMMED:
            row[name] += group[name]
        row["first_seen"] = min(row["first_seen"], group["first_seen"])
        row["last_seen"] = max(row["last_seen"], group["last_seen"])
    return list(rows.values())


def _sums_write(sums: Span, rows: list[dict]) -> None:
    """SQLite: rows of values, prepared as its columns store them, in slices under its parameter cap."""
    fields = [sums.model._meta.get_field(name) for name in sums.columns()]
    per_row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    values = [
        [field.get_db_prep_value(row[name], connection, prepared=False) for field, name in zip(fields, sums.columns(), strict=True)]
        for row in rows
    ]  # fmt: skip
    quoted = ", ".join(f'"{field.column}"' for field in fields)
    with connection.cursor() as cursor:
        for at in range(0, len(values), SUM_ROWS_PER_STATEMENT):
            chunk = values[at : at + SUM_ROWS_PER_STATEMENT]
            cursor.execute(
                f'INSERT INTO "{sums.model._meta.db_table}" ({quoted}) VALUES {", ".join([per_row] * len(chunk))} '  # noqa: S608
                + _upsert_clause(sums, "min", "max"),
                [value for row in chunk for value in row],
            )


def _sums_add_in_postgresql(sums: Span, windows: list[tuple[uuid.UUID, uuid.UUID, datetime]]) -> None:
    # The windows' workloads and starts pick the groups off the (workload, start) index within their
    # day partitions, then the window ids keep those of these windows. By start alone the read would
    # walk every workload's rows of those minutes: the whole fleet's. GROUP BY makes each key appear
    # once, as ON CONFLICT needs.
    quoted = ", ".join(f'"{name}"' for name in sums.columns())
    sql = (
        f'INSERT INTO "{sums.model._meta.db_table}" ({quoted}) '  # noqa: S608 - our names
        f"SELECT workload_id, {sums.start_in_postgresql()}, peer, protocol, port, decision,"
        f" {rule_stored_sql('rule_number')}, (array_agg(peer_workload_id))[1], sum(connection_count), sum(bytes_in),"
        f' sum(bytes_out), min(first_seen), max(last_seen) FROM "{FlowGroup._meta.db_table}"'
        " WHERE workload_id = ANY(%s) AND start >= %s AND start <= %s AND window_id = ANY(%s)"
        " GROUP BY 1, 2, 3, 4, 5, 6, 7 " + _upsert_clause(sums, "LEAST", "GREATEST")
    )
    starts = [start for _, _, start in windows]
    with connection.cursor() as cursor:
        cursor.execute(
            sql,
            [
                list({workload_id for _, workload_id, _ in windows}),
                min(starts),
                max(starts),
                [window_id for window_id, _, _ in windows],
            ],
        )

"""The writes of the sums: the groups of stored windows added to their quarters', hours' and blocks'
rows (every span of the ladder, flows/sums/ladder.py), once each, by serve's housekeeping."""

from __future__ import annotations

import logging
import time
import uuid
from datetime import datetime

from django.db import DataError, OperationalError, connection, transaction

from flows.models import FlowGroup, UnsummedWindow
from flows.sums.ladder import LADDER, SUMMED, Span, rule_stored_sql

log = logging.getLogger("palisade.flows")


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
# ... and at most this many groups: a workload's windows of thousands of keys must not make one long
# transaction. SQLite's is smaller: its one writer holds every other writer for the whole of it (10,000
# groups: about 0.25 s).
GROUPS_PER_SUM = {"postgresql": 250_000}
GROUPS_PER_SUM_ELSEWHERE = 10_000


def _within_groups(candidates: list[tuple]) -> list[tuple[uuid.UUID, uuid.UUID, datetime]]:
    """The first of `candidates` (id, workload, start, groups) whose groups fit one transaction's
    budget (at least one window)."""
    most = GROUPS_PER_SUM.get(connection.vendor, GROUPS_PER_SUM_ELSEWHERE)
    taken, groups = [], 0
    for window_id, workload_id, start, keys in candidates:
        groups += keys
        if taken and groups > most:
            break
        taken.append((window_id, workload_id, start))
    return taken


# A round of summing ends after this long even with windows left, which the next round (a minute later)
# takes on: a flood of keys makes summing lag, never a housekeeping round that does not end (nor a
# serve that cannot stop: it waits for the round under way). Rollups read what is not summed yet.
SUM_ROUND_SECONDS = 15.0


def flow_windows_sum(
    *, before: datetime, most: int = WINDOWS_PER_SUM, seconds: float = SUM_ROUND_SECONDS
) -> int:
    """Add the groups of the stored windows that started before `before` and are not summed yet to
    their quarters', hours' and blocks' sums; returns how many windows. Each batch of `most` windows
    (fewer when their groups pass GROUPS_PER_SUM) is one transaction that removes the windows from
    UnsummedWindow and adds their groups, so a window is summed exactly once, into each, even with two
    serve processes at it (each skips the rows the other holds).

    A batch whose sums would leave their columns' range (a workload's flood of windows, or counts an
    older version accepted) is summed in halves, down to the windows that cannot be added: those stay
    unsummed, read from their minute rows by every rollup, and are tried again on the next round. One
    workload's counts never stop the fleet's sums.

    A call returns once `seconds` have passed, at the end of a transaction, with windows left."""
    summed, left_out = 0, set()
    ends = time.monotonic() + seconds
    while True:
        taken: list[tuple[uuid.UUID, uuid.UUID, datetime]] = []
        try:
            with transaction.atomic():
                taken = _within_groups(
                    UnsummedWindow.objects.filter(start__lt=before)
                    .exclude(window_id__in=left_out)
                    .order_by("workload_id", "start")
                    .select_for_update(skip_locked=True)
                    .values_list("window_id", "workload_id", "start", "keys")[:most]
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
        if time.monotonic() >= ends:
            return summed


# PostgreSQL's "bigint out of range"; on SQLite, sum() past its 64-bit integers (_sums_add_in_sqlite).
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
    sums, one upsert per workload, span and key, summed by the database where the groups lie."""
    for sums in LADDER:
        if connection.vendor == "postgresql":
            _sums_add_in_postgresql(sums, windows)
        else:
            _sums_add_in_sqlite(sums, windows)


def _sums_add_in_sqlite(sums: Span, windows: list[tuple[uuid.UUID, uuid.UUID, datetime]]) -> None:
    """As on PostgreSQL, the database sums the groups where they lie: SQLite's one writer holds every
    other for the whole transaction, and summing in Python there (0.4 s for 10,000 groups alone) took
    5-8 s while other threads parsed reports. The windows' ids pick their groups off the window index."""
    quoted = ", ".join(f'"{name}"' for name in sums.columns())
    sql = (
        f'INSERT INTO "{sums.model._meta.db_table}" ({quoted}) '  # noqa: S608 - our names
        f"SELECT workload_id, {sums.start_in_sqlite()}, peer, protocol, port, decision,"
        f" {rule_stored_sql('rule_number')}, direction, failsafe, max(peer_workload_id), sum(connection_count),"
        " sum(bytes_in),"
        f' sum(bytes_out), min(first_seen), max(last_seen) FROM "{FlowGroup._meta.db_table}"'
        f" WHERE window_id IN ({', '.join(['%s'] * len(windows))})"
        " GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9 " + _upsert_clause(sums, "min", "max")
    )
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql, [window_id.hex for window_id, _, _ in windows])
    except OperationalError as error:  # sum() past a 64-bit integer: as Python's own sum would have
        if "integer overflow" not in str(error):
            raise
        raise OverflowError(str(error)) from error


def _sums_add_in_postgresql(sums: Span, windows: list[tuple[uuid.UUID, uuid.UUID, datetime]]) -> None:
    # The windows' workloads and starts pick the groups off the (workload, start) index within their
    # day partitions, then the window ids keep those of these windows. By start alone the read would
    # walk every workload's rows of those minutes: the whole fleet's. GROUP BY makes each key appear
    # once, as ON CONFLICT needs.
    quoted = ", ".join(f'"{name}"' for name in sums.columns())
    sql = (
        f'INSERT INTO "{sums.model._meta.db_table}" ({quoted}) '  # noqa: S608 - our names
        f"SELECT workload_id, {sums.start_in_postgresql()}, peer, protocol, port, decision,"
        f" {rule_stored_sql('rule_number')}, direction, failsafe, (array_agg(peer_workload_id))[1], sum(connection_count),"
        " sum(bytes_in),"
        f' sum(bytes_out), min(first_seen), max(last_seen) FROM "{FlowGroup._meta.db_table}"'
        " WHERE workload_id = ANY(%s) AND start >= %s AND start <= %s AND window_id = ANY(%s)"
        " GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9 " + _upsert_clause(sums, "LEAST", "GREATEST")
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

"""Flow evidence in PostgreSQL tables partitioned by day (declarative range partitioning).

Windows and their groups are partitioned by the window's `start`, gaps by their `end`, one partition per
UTC day, named `<table>_pYYYYMMDD`. serve's housekeeping creates them ahead of time; ingestion creates
the one a report needs if it is missing (a window buffered for days, a skewed clock). Retention drops
whole partitions, which costs nothing, instead of deleting rows. On SQLite the tables are plain, every
function here does nothing, and retention deletes rows.

Primary keys include the partition key, as PostgreSQL requires: (id, start) for windows and groups,
(id, end) for gaps. Idempotent ingestion does not rest on that key: it holds the workload's row lock and
looks ids up first (flows/services.py).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from datetime import UTC, date, datetime, time, timedelta

from django.db import DatabaseError, connection, transaction

from flows.sums.ladder import LADDER

# table -> the column it is partitioned by; the sums' tables are the ladder's (flows/sums/ladder.py)
PARTITIONED = {
    "flows_flowwindow": "start",
    "flows_flowgroup": "start",
    **{rung.table: rung.column for rung in LADDER},
    "flows_evidencegap": "end",
}
DAYS_AHEAD = 3
# Each rung's storage options (flows.sums.ladder.Span.storage); the other tables are only ever appended to.
STORAGE = {rung.table: rung.storage for rung in LADDER if rung.storage}
_NAME = re.compile(r"_p(\d{8})$")
_known: set[str] = set()  # partitions this process has seen exist: ingestion checks nothing twice


def partitioned() -> bool:
    return connection.vendor == "postgresql"


@functools.lru_cache(maxsize=4096)  # asked for every table of every report's days: strftime is slow
def partition_name(table: str, day: date) -> str:
    return f"{table}_p{day:%Y%m%d}"


def _bounds(day: date) -> tuple[str, str]:
    start = datetime.combine(day, time(0), tzinfo=UTC)
    return start.isoformat(), (start + timedelta(days=1)).isoformat()


def flow_partitions_ensure(*, days: Iterable[date]) -> int:
    """Create the day partitions of every flow table for `days` that do not exist; returns how many
    were created. Safe against a concurrent creator (the loser's savepoint is rolled back)."""
    if not partitioned():
        return 0
    created = 0
    for day in sorted(set(days)):
        for table in PARTITIONED:
            name = partition_name(table, day)
            if name in _known:
                continue
            low, high = _bounds(day)
            try:
                with transaction.atomic(), connection.cursor() as cursor:
                    cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
                    if not cursor.fetchone()[0]:
                        cursor.execute(
                            f'CREATE TABLE "{name}" PARTITION OF "{table}" '  # noqa: S608 - names are ours
                            f"FOR VALUES FROM ('{low}') TO ('{high}'){STORAGE.get(table, '')}"
                        )
                        created += 1
            except DatabaseError:
                # Another process created it between the check and the CREATE: it exists now.
                pass
            # Remembered once committed: a partition created in a transaction rolled back is gone.
            transaction.on_commit(lambda name=name: _known.add(name))
    return created


def flow_partitions_ahead(*, now: datetime) -> int:
    """Yesterday to DAYS_AHEAD days ahead, so ingestion rarely has to create one."""
    today = now.astimezone(UTC).date()
    return flow_partitions_ensure(days=(today + timedelta(days=d) for d in range(-1, DAYS_AHEAD + 1)))


def flow_partitions_list() -> dict[str, list[tuple[str, date]]]:
    """Each partitioned table's day partitions, oldest first."""
    if not partitioned():
        return {}
    out: dict[str, list[tuple[str, date]]] = {table: [] for table in PARTITIONED}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT parent.relname, child.relname FROM pg_inherits "
            "JOIN pg_class parent ON parent.oid = pg_inherits.inhparent "
            "JOIN pg_class child ON child.oid = pg_inherits.inhrelid "
            "WHERE parent.relname = ANY(%s)",
            [list(PARTITIONED)],
        )
        for parent, child in cursor.fetchall():
            match = _NAME.search(child)
            if match:
                out[parent].append((child, datetime.strptime(match.group(1), "%Y%m%d").date()))
    for partitions in out.values():
        partitions.sort(key=lambda item: item[1])
    return out


def flow_partitions_drop(*, before: datetime) -> int:
    """Drop the day partitions whose every row is older than `before`: a gap partition once its day
    has ended before it (gaps are partitioned by their end); a window or group partition a day later,
    since a window that starts on one day may end on the next. Returns how many were dropped."""
    dropped = 0
    cutoff = before.astimezone(UTC)
    for table, partitions in flow_partitions_list().items():
        margin = timedelta(0) if PARTITIONED[table] == "end" else timedelta(days=1)
        for name, day in partitions:
            if datetime.combine(day, time(0), tzinfo=UTC) + timedelta(days=1) + margin > cutoff:
                continue
            with connection.cursor() as cursor:
                # Deferred foreign-key checks of rows written earlier in this transaction must run
                # before their table can be dropped.
                cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
                cursor.execute(f'DROP TABLE IF EXISTS "{name}"')
            _known.discard(name)
            dropped += 1
    return dropped

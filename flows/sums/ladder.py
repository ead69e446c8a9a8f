"""The sums ladder: what a rollup reads instead of every minute row.

Agents send windows of a minute; each window's groups (one per peer, service, decision and rule) are
stored as minute rows (FlowGroup). A few minutes after each ten-minute block ends, serve's housekeeping
adds the groups of the windows that started in it to one row per key in each span of the ladder
(flows/sums/writes.py `flow_windows_sum`): quarter days (six hours), hours and ten-minute blocks. All
spans start at multiples of their length from one origin, in UTC, as PostgreSQL's date_bin counts
them (flows/buckets.py). A rollup then reads its range's whole quarters from the quarters, the whole
hours beside them from the hours, the whole blocks beside those from the blocks, and minute rows only
at the two edges and for windows not summed yet (flows/sums/reads.py, for flows.selectors'
`flow_rollup_read` and the reads of draft policy).

LADDER below is the one list of spans: the writes, the read plan (flows/sums/), the day partitions
(flows/partitions.py) and pruning (flows.services `flow_evidence_prune`) all read it. A new span is
an entry here, a model (a FlowSums subclass) and its migration; tests/flows/test_sums_ladder.py fails
if a model of sums is missing here or a span is left out of a read.

The sums' key columns cannot hold a null, so a group that no rule decided is stored with rule number 0
(NO_RULE) and read back as None (`rule_stored`, `rule_read`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from flows.buckets import ORIGIN, span_start
from flows.models import FlowBlock, FlowHour, FlowQuarter, FlowSums

NO_RULE = 0
SUMMED = ("connection_count", "bytes_in", "bytes_out")


@dataclass(frozen=True)
class Span:
    """One rung of the ladder: its model, the column holding a row's span start, the span, and how
    long after the retention cutoff its rows are kept."""

    model: type[FlowSums]
    column: str
    span: timedelta
    # A span's windows start in it and end within the hour after it (a window lasts at most an hour):
    # its sums go once both are past the cutoff.
    prune_margin: timedelta
    # Storage options of its day partitions (flows/partitions.py): updated in place, so room is left
    # on each page for the new row version (a HOT update).
    storage: str = ""

    @property
    def table(self) -> str:
        return self.model._meta.db_table

    def key(self) -> tuple[str, ...]:
        return (
            "workload_id", self.column, "peer", "protocol", "port", "decision", "rule_number", "direction",
            "failsafe",
        )  # fmt: skip

    def columns(self) -> tuple[str, ...]:
        return (*self.key(), "peer_workload_id", *SUMMED, "first_seen", "last_seen")

    def start_in_postgresql(self) -> str:
        """The span's start of a group's `start` in SQL, as `span_start` finds it."""
        origin = ORIGIN.isoformat(sep=" ")
        return f"date_bin('{int(self.span.total_seconds())} seconds', start, TIMESTAMPTZ '{origin}')"

    def start_in_sqlite(self) -> str:
        """The same in SQLite, as its column stores it (`YYYY-MM-DD HH:MM:SS`, UTC), for starts after
        ORIGIN (windows are stored back to the retention only). For a statement with parameters: its
        `%` is doubled, as Django's placeholders need."""
        origin, span = int(ORIGIN.timestamp()), int(self.span.total_seconds())
        seconds = "CAST(strftime('%%s', start) AS INTEGER)"
        return f"datetime(({seconds} - {origin}) / {span} * {span} + {origin}, 'unixepoch')"

    def start_of(self, instant: datetime) -> datetime:
        return span_start(instant, self.span)


QUARTER = timedelta(hours=6)
HOUR = timedelta(hours=1)
BLOCK = timedelta(minutes=10)
_HOT = " WITH (fillfactor = 70)"

# Longest span first: a range is read from the longest spans that fit, the parts beside them from the
# next. The last is the shortest, the block that summing runs by.
LADDER = (
    Span(FlowQuarter, "quarter", QUARTER, prune_margin=QUARTER + HOUR, storage=_HOT),
    Span(FlowHour, "hour", HOUR, prune_margin=2 * HOUR, storage=_HOT),
    # Updated in place only for a window that arrives after its block was summed: appended to otherwise.
    Span(FlowBlock, "block", BLOCK, prune_margin=2 * HOUR),
)

# A block's windows are summed this long after it ends: by then the windows that started in it (a
# minute long by default, sent as they close) have arrived, so its rows are written once and its
# hour's rows once a block. A window arriving later is summed on a later round, adding to the rows.
SUMMED_AFTER = timedelta(minutes=3)
# Unsummed windows are pruned with the shortest span's rows.
UNSUMMED_PRUNE_MARGIN = LADDER[-1].prune_margin


def sums_due(*, now: datetime) -> datetime:
    """Windows that start before this are summed by serve's housekeeping (flows/sums/writes.py
    `flow_windows_sum`): those of every block over by SUMMED_AFTER."""
    return span_start(now - SUMMED_AFTER, BLOCK)


def rule_stored(number: int | None) -> int:
    """A group's rule number as the sums store it: NO_RULE for none."""
    return NO_RULE if number is None else number


def rule_stored_sql(column: str) -> str:
    return f"coalesce({column}, {NO_RULE})"


def rule_read(number: int | None) -> int | None:
    """A rule number read from the sums as the minute rows hold it: None for none."""
    return None if number == NO_RULE else number

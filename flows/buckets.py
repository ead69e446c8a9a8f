"""The spans flow sums are kept over: quarter days (six hours), hours for the part-quarters at a range's
edges, and ten-minute blocks for the part-hours. All start at multiples of their span from one origin,
in UTC, as PostgreSQL's date_bin counts them (flows/services.py sums there, flows/selectors.py reads
here)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

QUARTER = timedelta(hours=6)
HOUR = timedelta(hours=1)
BLOCK = timedelta(minutes=10)
ORIGIN = datetime(2000, 1, 1, tzinfo=UTC)


# A block's windows are summed this long after it ends: by then the windows that started in it (a
# minute long by default, sent as they close) have arrived, so its rows are written once and its
# hour's rows once a block. A window arriving later is summed on a later round, adding to the rows.
SUMMED_AFTER = timedelta(minutes=3)


def sums_due(*, now: datetime) -> datetime:
    """Windows that start before this are summed by serve's housekeeping (flows.services
    flow_windows_sum): those of every block over by SUMMED_AFTER."""
    return span_start(now - SUMMED_AFTER, BLOCK)


def span_start(instant: datetime, span: timedelta) -> datetime:
    """The start of the span that holds `instant`."""
    return instant - (instant - ORIGIN) % span


def whole_spans(start: datetime, end: datetime, span: timedelta) -> tuple[datetime, datetime] | None:
    """The start of the first whole span inside [start, end) and the end of the last, or None when
    there is none."""
    first = span_start(start, span)
    if first < start:
        first += span
    last = span_start(end, span)
    return (first, last) if first < last else None

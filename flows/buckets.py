"""The spans flow sums are kept over: hours, and ten-minute blocks for the part-hours at a range's
edges. Both start at multiples of their span from one origin, in UTC, as PostgreSQL's date_bin counts
them (flows/services.py sums there, flows/selectors.py reads here)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

HOUR = timedelta(hours=1)
BLOCK = timedelta(minutes=10)
ORIGIN = datetime(2000, 1, 1, tzinfo=UTC)


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

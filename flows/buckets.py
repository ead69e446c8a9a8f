"""Span arithmetic: spans start at multiples of their length from one origin, in UTC, as PostgreSQL's
date_bin counts them. The spans themselves are the sums ladder's (flows/sums/ladder.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

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

"""How long flow evidence is kept: serve's `--flow-retention-days`, and an hour more, so that "the last
N days" asked at any moment is still whole when N is the retention (pruning runs hourly with its own
clock, and a range computed a moment earlier would otherwise begin a moment before the cutoff)."""

from __future__ import annotations

from datetime import timedelta

from controlplane import runtime

MARGIN = timedelta(hours=1)


def flow_retention() -> timedelta:
    """Evidence that ended longer ago than this may be removed; anything newer is kept."""
    return timedelta(days=runtime.facts.retention_days) + MARGIN

"""How long flow evidence is kept: serve's `--flow-retention-days`, and an hour more, so that "the last
N days" asked at any moment is still whole when N is the retention (pruning runs hourly with its own
clock, and a range computed a moment earlier would otherwise begin a moment before the cutoff)."""

from __future__ import annotations

from datetime import timedelta

from controlplane import runtime
from controlplane.service_identity import recorded_flow_retention_days

MARGIN = timedelta(hours=1)


def flow_retention() -> timedelta:
    """Evidence that ended longer ago than this may be removed; anything newer is kept."""
    return timedelta(days=flow_retention_days()) + MARGIN


def flow_retention_days() -> int:
    """Inside serve, its own; in a command run beside it (`manage.py flows`), the one serve recorded at
    its last start, which may differ from this process's environment; before any start, the
    environment's."""
    if runtime.facts.flow_retention_days is not None:
        return runtime.facts.flow_retention_days
    recorded = recorded_flow_retention_days()
    return recorded if recorded is not None else runtime.facts.retention_days

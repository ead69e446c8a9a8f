"""The spec's chips and texts from a workload as the API returns it, and the plot's geometry."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from controlplane.console.chips import duration_text, workload_chips
from controlplane.console.plots import connections_plot

NOW = datetime(2026, 11, 26, 12, 0, 0, tzinfo=UTC)


def workload(**overrides) -> dict:
    base = {
        "sync": {
            "state": "synced",
            "last_heard_from": "2026-11-26T11:59:00Z",
            "error": None,
            "pending_version": None,
        },
        "health": {
            "telemetry_live": False,
            "clock_skew": None,
            "evidence_gap": None,
            "owned_table": {"state": "present"},
            "credential": {
                "state": "renews",
                "expires_at": "2026-12-20T00:00:00Z",
                "renewal_due_at": "2026-11-26T15:30:00Z",
                "last_error": None,
                "last_late_renewal": None,
                "last_late_renewal_late_by_seconds": None,
            },
        },
    }
    for path, value in overrides.items():
        target = base
        *parents, leaf = path.split("__")
        for parent in parents:
            target = target[parent]
        target[leaf] = value
    return base


def labels(item: dict) -> list[str]:
    return [chip.label for chip in workload_chips(item, NOW)]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, ["synced", "renewal due in 3 h 30 min"]),
        ({"health__credential__renewal_due_at": "2026-11-26T11:00:00Z"}, ["synced", "renewal due now"]),
        ({"sync__state": "offline", "sync__last_heard_from": None}, ["offline: never connected", "renewal due in 3 h 30 min"]),
        ({"sync__state": "offline", "sync__last_heard_from": "2026-11-26T09:00:00Z"}, ["offline: last contact 3 h ago", "renewal due in 3 h 30 min"]),
        ({"sync__state": "offline", "health__telemetry_live": True}, ["Reconnecting", "renewal due in 3 h 30 min"]),
        ({"sync__state": "degraded", "sync__error": "Error: no such set"}, ["degraded: Error: no such set", "renewal due in 3 h 30 min"]),
        ({"sync__state": "pending", "sync__pending_version": "sha256:abcdef0123456789"}, ["pending: abcdef012345 not yet applied", "renewal due in 3 h 30 min"]),
        ({"health__owned_table": {"state": "absent"}}, ["Enforcement removed on host", "renewal due in 3 h 30 min"]),
        ({"health__owned_table": {"state": "present", "modified_at": "2026-11-26T11:50:00Z", "restored_at": "2026-11-26T11:50:00.1Z", "modification": "chain input: 1 rule added"}},
         ["synced", "Table edited on host 10 min ago, restored", "renewal due in 3 h 30 min"]),
        ({"health__owned_table": {"state": "present", "modified_at": "2026-11-26T11:50:00Z", "restored_at": None, "modification": "chain input: 1 rule added"}},
         ["synced", "Table edited on host 10 min ago, NOT restored", "renewal due in 3 h 30 min"]),
        ({"health__owned_table": {"state": "present", "modified_at": "2026-11-24T11:50:00Z", "restored_at": "2026-11-24T11:50:01Z", "modification": "x"}},
         ["synced", "renewal due in 3 h 30 min"]),
        ({"health__credential__state": "renewal-failed", "health__credential__last_error": "disk full"}, ["synced", "renewal failed, retrying"]),
        ({"health__credential__state": "expired"}, ["synced", "Credential expired"]),
        ({"health__credential__revoked": {"at": "2026-11-26T11:00:00Z", "reason": "key stolen"}}, ["synced", "Credential revoked"]),
        ({"health__credential__last_late_renewal": "2026-11-25T00:00:00Z", "health__credential__last_late_renewal_late_by_seconds": 7300},
         ["synced", "renewal due in 3 h 30 min", "renewed 2 h 1 min late"]),
        ({"health__clock_skew": {"offset_seconds": -185.0, "seen_at": "2026-11-26T11:58:00Z"}}, ["synced", "renewal due in 3 h 30 min", "Clock skew 3 min behind"]),
        ({"health__evidence_gap": {"kind": "source_overrun", "start": "2026-11-26T10:00:00Z", "end": "2026-11-26T10:01:00Z"}},
         ["synced", "renewal due in 3 h 30 min", "Evidence gap 2026-11-26 10:00:00 – 2026-11-26 10:01:00"]),
    ],
)  # fmt: skip
def test_each_state_gives_the_spec_text(overrides, expected):
    assert labels(workload(**overrides)) == expected


def test_durations_read_as_people_say_them():
    assert [duration_text(s) for s in (0, 59, 60, 3599, 3600, 5400, 86400, 90000)] == [
        "0 s", "59 s", "1 min", "59 min", "1 h", "1 h 30 min", "1 d", "1 d 1 h",
    ]  # fmt: skip


def test_the_plot_stacks_decisions_per_window_where_each_window_lies_in_the_range():
    rows = [
        {"window_start": "2026-11-26T11:00:00.000000Z", "decision": "allowed", "connection_count": 3},
        {"window_start": "2026-11-26T11:00:00.000000Z", "decision": "would_block", "connection_count": 1},
        {"window_start": "2026-11-26T11:30:00.000000Z", "decision": "blocked", "connection_count": 2},
    ]
    plot = connections_plot(rows, start="2026-11-26T11:00:00Z", end="2026-11-26T12:00:00Z")
    assert plot.peak == 4 and plot.totals == {"allowed": 3, "observed": 0, "would_block": 1, "blocked": 2}
    allowed, would_block, blocked = plot.bars
    assert allowed.x == would_block.x < blocked.x
    assert would_block.y + would_block.height == pytest.approx(allowed.y)  # stacked
    assert allowed.height == pytest.approx(3 * would_block.height)
    assert blocked.x == pytest.approx(48 + (720 - 48) / 2)  # half way through the range
    assert connections_plot([], start="2026-11-26T11:00:00Z", end="2026-11-26T12:00:00Z").empty

"""Rollups (and the review's would-block groups) read whole quarter days, hours and ten-minute blocks
from their sums and the minute rows at the edges: for any range and grouping the answer equals summing
the minute rows themselves (SQLite and PostgreSQL)."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, timedelta

import pytest
from django.db.models import Sum

from controlplane import clock
from flows.buckets import span_start
from flows.models import FlowBlock, FlowGroup, FlowHour, FlowQuarter, UnsummedWindow
from flows.selectors import (
    flow_range_plan,
    flow_rollup,
    groups_in_range,
    key_sums,
    ruleset_of_rule,
    simulation_review,
)
from flows.services import flow_report_ingest
from flows.sums.ladder import BLOCK, HOUR, QUARTER
from flows.sums.writes import flow_windows_sum
from tests.support.flow_evidence import enrolled, flow_report

GROUPINGS = [
    ["peer", "service"],
    ["workload", "decision"],
    ["rule"],
    ["peer_workload", "decision", "rule"],
    ["ruleset", "peer"],
]


def _instant(at) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _random_windows(rng: random.Random, begin, count: int, minutes: int = 240) -> list[dict]:
    windows = []
    for minute in sorted(rng.sample(range(0, minutes), count)):
        start = begin + timedelta(minutes=minute)
        groups = {}
        for _ in range(rng.randrange(1, 5)):
            peer, port = rng.choice(["10.50.0.2", "10.9.9.9", "192.0.2.1"]), rng.choice([22, 443])
            decision = rng.choice(["allowed", "would_block", "observed"])
            rule = rng.choice([None, 7]) if decision == "allowed" else None
            groups[(peer, port, decision, rule)] = {
                "peer": peer, "protocol": "tcp", "port": port, "decision": decision, "rule": rule,
                # Instants to the microsecond: a read of the sums must not round them.
                "connection_count": rng.randrange(1, 9),
                "first_seen": _instant(start + timedelta(seconds=1, microseconds=rng.randrange(10**6))),
                "last_seen": _instant(start + timedelta(seconds=rng.randrange(2, 60), microseconds=rng.randrange(10**6))),
                "bytes_in": 0, "bytes_out": 0,
            }  # fmt: skip
        windows.append({"id": str(uuid.uuid4()), "start": _instant(start), "end": _instant(start + timedelta(minutes=1)),
                        "policy_version": "v", "accounting": False, "groups": list(groups.values())})  # fmt: skip
    return windows


def _expected(start, end, group_by) -> list[dict]:
    from flows.validation import GROUP_KEYS

    columns = [column for name in group_by for column in GROUP_KEYS[name]]
    groups = _minute_rows(start, end)
    if "ruleset_id" in columns:
        groups = groups.annotate(ruleset_id=ruleset_of_rule())
    return list(key_sums(groups, columns))


def _minute_rows(start, end):
    """Every minute row (group) of the range, none from the sums: the oracle."""
    return groups_in_range(flow_range_plan(selected=None, start=start, end=end))


def _key(row):
    # With each value's type: a count read back as text or a Decimal prints as the int does.
    return tuple(sorted((k, type(v).__name__, str(v)) for k, v in row.items()))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sums_and_edges_add_up_to_the_minute_rows(db, seed):
    rng = random.Random(seed)
    web, _, _ = enrolled("web", "10.50.0.1")
    enrolled("db", "10.50.0.2")
    # Fifteen hours: at least two whole quarter days, wherever the clock stands.
    begin = (clock.now() - timedelta(hours=15)).replace(minute=0, second=0, microsecond=0)
    windows = _random_windows(rng, begin, 90, minutes=840)
    halfway = begin + timedelta(minutes=430)  # a block, not an hour: an hour and a quarter summed in part
    for chunk in (windows[:25], windows[25:]):  # two reports: hours summed across reports
        answer = flow_report_ingest(workload_id=str(web.id), data=flow_report("p1", 100, chunk))
        assert all(r["result"] == "accepted" for r in answer["windows"])
    # Rollups add up the same before summing, half summed (a summed hour with windows arriving after
    # it was summed) and all summed.
    _rollups_equal_the_minute_rows(rng, begin)
    assert flow_windows_sum(before=halfway, most=7) == sum(w["start"] < _instant(halfway) for w in windows)
    late = _random_windows(rng, begin, 10, minutes=840)
    flow_report_ingest(workload_id=str(web.id), data=flow_report("p1", 100, late))
    _rollups_equal_the_minute_rows(rng, begin)
    assert flow_windows_sum(before=clock.now()) == 90 + 10 - sum(
        w["start"] < _instant(halfway) for w in windows
    )
    counts = [model.objects.count() for model in (FlowQuarter, FlowHour, FlowBlock, FlowGroup)]
    assert 0 < counts[0] < counts[1] < counts[2] < counts[3], counts
    assert not UnsummedWindow.objects.exists()
    _rollups_equal_the_minute_rows(rng, begin)


def _rollups_equal_the_minute_rows(rng: random.Random, begin) -> None:
    ranges = [(begin - timedelta(minutes=3), begin + timedelta(hours=15))]  # every kind of sum
    for _ in range(12):
        start = begin + timedelta(minutes=rng.randrange(-30, 800), seconds=rng.choice([0, 17]))
        ranges.append((start, start + timedelta(minutes=rng.choice([20, 61, 150, 300, 420, 720]))))
    for start, end in ranges:
        for group_by in GROUPINGS:
            rows, _ = flow_rollup(
                selected=None, group_by=group_by, start=start, end=end, cursor=None, limit=500
            )
            assert sorted(map(_key, rows)) == sorted(map(_key, _expected(start, end, group_by))), (
                start,
                end,
                group_by,
            )
        # The review's would-block groups come the same way, most connections first.
        would_block = simulation_review(selected=None, start=start, end=end)["would_block"]
        expected = key_sums(
            _minute_rows(start, end).filter(decision="would_block"),
            ["workload_id", "peer", "protocol", "port", "rule_number"],
        ).order_by("-connection_count", "workload_id", "peer", "protocol", "port", "rule_number")
        named = [{k: v for k, v in row.items() if k != "rule_action"} for row in would_block]
        assert [_key(row) for row in named] == [_key(row) for row in expected], (start, end)


def test_housekeeping_sums_a_block_once_it_is_a_few_minutes_over_into_its_hour_and_block(db, clock_at):
    from controlplane.housekeeping import flow_windows_sum_step
    from tests.support.flow_evidence import windows_between

    web, _, _ = enrolled("web", "10.50.0.1")
    block = span_start(clock.now(), BLOCK) - 2 * BLOCK
    earlier, later = (windows_between(start - timedelta(minutes=1), 10) for start in (block, block + BLOCK))
    flow_report_ingest(workload_id=str(web.id), data=flow_report("p1", 100, earlier + later))
    clock_at(block + BLOCK + timedelta(minutes=2) - clock.now())
    assert flow_windows_sum_step() == 0  # windows of the block just over may still be on their way
    clock_at(timedelta(minutes=2))
    assert flow_windows_sum_step() == len(earlier) == 10
    assert {b.block for b in FlowBlock.objects.all()} == {block}
    assert {h.hour for h in FlowHour.objects.all()} == {span_start(block, HOUR)}
    assert {q.quarter for q in FlowQuarter.objects.all()} == {span_start(block, QUARTER)}
    clock_at(BLOCK)
    assert flow_windows_sum_step() == len(later) and not UnsummedWindow.objects.exists()
    assert {b.block for b in FlowBlock.objects.all()} == {block, block + BLOCK}
    # Both blocks' windows are in their hours' and quarters' sums, once each.
    for model in (FlowQuarter, FlowHour, FlowBlock):
        assert model.objects.aggregate(total=Sum("connection_count"))["total"] == 20


@pytest.mark.postgres
def test_serve_processes_summing_at_once_sum_each_window_once(transactional_db):
    from django.db import connection
    from django.db.models import Sum

    from tests.support.helpers import race
    from tests.support.requirements import require

    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    rng = random.Random(5)
    begin = (clock.now() - timedelta(hours=5)).replace(minute=0, second=0, microsecond=0)
    for index in range(3):
        workload, _, _ = enrolled(f"web-{index}", f"10.50.0.{index + 1}")
        windows = _random_windows(rng, begin, 40)
        flow_report_ingest(workload_id=str(workload.id), data=flow_report("p1", 100, windows))
    results = race(*[lambda: flow_windows_sum(before=clock.now(), most=7) for _ in range(4)])
    assert sum(results) == 120, results
    sums = {
        model: {
            tuple(row.values())
            for row in model.objects.values("workload_id", "peer", "port", "decision").annotate(
                n=Sum("connection_count")
            )
        }
        for model in (FlowQuarter, FlowHour, FlowBlock, FlowGroup)
    }
    assert sums[FlowQuarter] == sums[FlowHour] == sums[FlowBlock] == sums[FlowGroup]


def test_windows_whose_sums_leave_their_columns_range_stay_unsummed_and_the_rest_is_summed(db, caplog):
    """Counts an older version accepted (up to 2**62 a window): two of one key overflow a 64-bit sum.
    Summing halves its batch down to the window that cannot be added, which stays unsummed (and is
    read from its minute rows); every other workload's windows are summed, then and on later rounds."""
    from django.db import connection

    rng = random.Random(9)
    # The two huge windows (minutes 118 and 156 of the range, from this seed) must share a span of every
    # rung of the ladder, the 6-hour quarter included, whatever the time of day: begin at a quarter's start.
    begin = span_start(clock.now() - QUARTER, QUARTER)
    flooded, _, _ = enrolled("flooded", "10.50.0.1")
    other, _, _ = enrolled("other", "10.50.0.2")
    huge = _random_windows(rng, begin, 2)
    for window in huge:
        window["groups"] = [
            {**window["groups"][0], "peer": "10.9.9.9", "port": 22, "decision": "observed", "rule": None}
        ]
    flow_report_ingest(workload_id=str(flooded.id), data=flow_report("p1", 100, huge))
    FlowGroup.objects.filter(workload=flooded).update(connection_count=2**62)
    flow_report_ingest(
        workload_id=str(other.id), data=flow_report("p1", 100, _random_windows(rng, begin, 30))
    )
    # Both huge windows in one batch overflow on either database. Added alone, the second overflows
    # PostgreSQL's bigint; SQLite's own addition turns an int64 overflow into a float and takes it.
    postgresql = connection.vendor == "postgresql"
    assert flow_windows_sum(before=clock.now(), most=50) == (31 if postgresql else 32)
    assert ("cannot sum flow window" in caplog.text) is postgresql
    left = [flooded.id] if postgresql else []
    assert list(UnsummedWindow.objects.values_list("workload_id", flat=True)) == left
    summed = FlowHour.objects.filter(workload=other).aggregate(total=Sum("connection_count"))["total"]
    assert (
        summed == FlowGroup.objects.filter(workload=other).aggregate(total=Sum("connection_count"))["total"]
    )
    late = _random_windows(rng, begin, 5)
    flow_report_ingest(workload_id=str(other.id), data=flow_report("p1", 100, late))
    assert flow_windows_sum(before=clock.now()) == 5  # a later round: the rest still summed
    if postgresql:  # SQLite's sums of such counts overflow on reading
        end = begin + timedelta(hours=5)
        rows, _ = flow_rollup(
            selected=None, group_by=["workload"], start=begin, end=end, cursor=None, limit=10
        )
        assert {row["workload_id"]: row["connection_count"] for row in rows}[flooded.id] == 2**63

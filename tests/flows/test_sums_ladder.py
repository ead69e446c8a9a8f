"""The sums ladder has one registry (flows.sums.ladder.LADDER): every table of sums is in it, and the writes,
the read plan, the day partitions and pruning all follow it. A span added to the registry alone is
written, read, partitioned and pruned; a model of sums left out of it fails here."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from itertools import pairwise

from django.apps import apps

from controlplane import clock
from flows.buckets import ORIGIN, span_start
from flows.choices import MAX_WINDOW_SECONDS
from flows.models import FlowGroup, FlowSums, FlowWindow, UnsummedWindow
from flows.partitions import PARTITIONED, STORAGE, flow_partitions_ensure
from flows.selectors import flow_rollup
from flows.services import flow_evidence_prune
from flows.sums.ladder import LADDER, NO_RULE, rule_read, rule_stored, sums_due
from flows.sums.reads import sum_reads
from flows.sums.writes import flow_windows_sum
from tests.support.workloads import make_workload

SHORTEST, LONGEST = LADDER[-1].span, LADDER[0].span


def test_every_model_of_sums_is_a_rung_of_the_ladder_and_every_rung_a_model_of_sums():
    models = {model for model in apps.get_models() if issubclass(model, FlowSums)}
    assert models == {rung.model for rung in LADDER}
    assert len(LADDER) == len(models)
    for rung in LADDER:
        rung.model._meta.get_field(rung.column)  # the column holding a row's span start exists


def test_the_ladder_runs_from_the_longest_span_down_each_a_whole_number_of_the_next():
    """A whole span of one rung is whole spans of the next, so the read plan can tile any range of whole
    blocks; every span divides a day, so no row's span straddles two day partitions."""
    spans = [rung.span for rung in LADDER]
    assert spans == sorted(spans, reverse=True) and len(set(spans)) == len(spans)
    for longer, shorter in pairwise(spans):
        assert longer % shorter == timedelta(0)
    assert all(timedelta(days=1) % span == timedelta(0) for span in spans)


def test_the_read_plan_reads_every_rung():
    """Over a range of three longest spans less a block at each end, every rung holds a whole span
    that no longer one does."""
    low, high = ORIGIN + SHORTEST, ORIGIN + 3 * LONGEST - SHORTEST
    assert {read.model for read in sum_reads(low, high)} == {rung.model for rung in LADDER}


def test_every_rung_is_a_day_partitioned_table_by_its_span_start():
    for rung in LADDER:
        assert PARTITIONED[rung.table] == rung.column
        assert STORAGE.get(rung.table, "") == rung.storage
    assert set(PARTITIONED) - {rung.table for rung in LADDER} == {
        FlowWindow._meta.db_table,
        FlowGroup._meta.db_table,
        "flows_evidencegap",
    }


def test_a_rungs_rows_outlive_the_windows_summed_into_them():
    """A span's windows start in it and may last the longest window after it: its row goes only once
    they are all past the cutoff."""
    for rung in LADDER:
        assert rung.prune_margin >= rung.span + timedelta(seconds=MAX_WINDOW_SECONDS)


def test_no_rule_is_stored_as_zero_and_read_back_as_none():
    assert rule_stored(None) == NO_RULE and rule_read(NO_RULE) is None
    assert rule_read(rule_stored(7)) == 7


def _minute_row(workload, start: datetime, *, rule_number=None) -> None:
    window = FlowWindow.objects.create(
        id=uuid.uuid4(), workload=workload, start=start, end=start + timedelta(minutes=1),
        accounting=False, received_at=start,
    )  # fmt: skip
    FlowGroup.objects.create(
        window=window, workload=workload, start=start, end=window.end, peer="10.9.9.9", protocol="tcp",
        port=22, decision="observed", rule_number=rule_number, connection_count=1, first_seen=start,
        last_seen=start, bytes_in=0, bytes_out=0,
    )  # fmt: skip
    UnsummedWindow.objects.create(window_id=window.id, workload=workload, start=start)


def _days(low: datetime, high: datetime) -> set:
    return {(low + timedelta(days=d)).date() for d in range((high - low).days + 2)}


def test_summing_writes_every_rung_and_pruning_removes_every_rung(db):
    workload = make_workload(render=False)
    start = span_start(clock.now() - 2 * LONGEST, LONGEST) + timedelta(minutes=1)
    flow_partitions_ensure(days=_days(start - LONGEST, start + LONGEST))
    _minute_row(workload, start)
    assert flow_windows_sum(before=sums_due(now=clock.now())) == 1
    for rung in LADDER:
        (row,) = rung.model.objects.values(rung.column, "rule_number", "connection_count")
        assert row == {rung.column: rung.start_of(start), "rule_number": NO_RULE, "connection_count": 1}
    flow_evidence_prune(older_than=-timedelta(days=1))  # everything is older than a day from now
    assert not any(rung.model.objects.exists() for rung in LADDER)


def test_a_rollup_over_whole_blocks_counts_each_block_once_from_whichever_rung_holds_it(db):
    """Every rung holds a row in every one of its spans across the range, counting the blocks in the
    span: the plan tiles the range from the rungs, so the total is the range's blocks, once each. A rung
    the plan skipped, or read as well as a longer one, would miss or double some."""
    workload = make_workload(render=False)
    base = span_start(clock.now() - timedelta(days=2), LONGEST)
    low, high = base + SHORTEST, base + 3 * LONGEST - SHORTEST
    flow_partitions_ensure(days=_days(base, high))
    for rung in LADDER:
        at = rung.start_of(low)
        while at < high:
            rung.model.objects.create(
                workload=workload, **{rung.column: at}, peer="10.9.9.9", protocol="tcp", port=22,
                decision="observed", rule_number=NO_RULE, connection_count=rung.span // SHORTEST,
                first_seen=at, last_seen=at, bytes_in=0, bytes_out=0,
            )  # fmt: skip
            at += rung.span
    rows, _ = flow_rollup(selected=None, group_by=["rule"], start=low, end=high, cursor=None, limit=10)
    assert rows == [
        {
            "rule_number": None,
            "connection_count": (high - low) // SHORTEST,
            "bytes_in": 0,
            "bytes_out": 0,
            "first_seen": low,
            "last_seen": high - SHORTEST,
        }
    ]

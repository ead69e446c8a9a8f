"""Flow evidence in day partitions on PostgreSQL: rows land in their day's partition, partitions are
made ahead and on demand, retention drops whole partitions, and a range read touches only its days."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from controlplane import clock, runtime
from flows.models import EvidenceGap, FlowGroup, FlowWindow
from flows.partitions import PARTITIONED, flow_partitions_ahead, flow_partitions_list
from flows.services import flow_report_ingest
from flows.sums.writes import flow_windows_sum
from tests.support.flow_evidence import at_agent_clock, enrolled, golden
from tests.support.requirements import require

pytestmark = pytest.mark.postgres


@pytest.fixture(autouse=True)
def on_postgres(db):
    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")


def partition_of(model, pk) -> str:
    with connection.cursor() as cursor:
        table = model._meta.db_table
        cursor.execute(f'SELECT tableoid::regclass::text FROM "{table}" WHERE id = %s', [pk])  # noqa: S608
        return cursor.fetchone()[0]


def exists(name: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
        return cursor.fetchone()[0]


def test_the_flow_tables_are_partitioned_by_day():
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, p.partstrat FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid"
        )
        strategies = dict(cursor.fetchall())
    assert {table: strategies.get(table) for table in PARTITIONED} == dict.fromkeys(PARTITIONED, "r")


def test_a_report_lands_in_its_days_partitions_made_on_demand():
    workload, _, _ = enrolled()
    flow_report_ingest(workload_id=str(workload.id), data=at_agent_clock(golden(), clock.now()))
    window = FlowWindow.objects.get()
    day = window.start.astimezone(UTC).strftime("%Y%m%d")  # 2027-01-15: no partition existed before
    assert partition_of(FlowWindow, window.id) == f"flows_flowwindow_p{day}"
    assert {partition_of(FlowGroup, g.id) for g in FlowGroup.objects.all()} == {f"flows_flowgroup_p{day}"}
    gap = EvidenceGap.objects.get()
    assert partition_of(EvidenceGap, gap.id) == f"flows_evidencegap_p{gap.end.astimezone(UTC):%Y%m%d}"
    again = flow_report_ingest(workload_id=str(workload.id), data=at_agent_clock(golden(), clock.now()))
    assert [r["result"] for r in again["windows"] + again["gaps"]] == ["accepted", "accepted"]
    assert FlowWindow.objects.count() == 1 and EvidenceGap.objects.count() == 1  # still idempotent


def test_the_sums_of_hours_and_quarters_are_updated_in_place_on_pages_with_room_for_it():
    from tests.support.flow_evidence import flow_report, windows_between

    workload, _, _ = enrolled()
    hour = clock.now().replace(minute=0, second=0, microsecond=0)
    first, second = windows_between(hour, 2)  # two minutes of one hour, the same key
    for window in (first, second):  # the second arrives after the first was summed
        flow_report_ingest(workload_id=str(workload.id), data=flow_report("p", 100, [window]))
        assert flow_windows_sum(before=hour + timedelta(hours=1)) == 1
    for table in ("flows_flowhour", "flows_flowquarter"):
        name = f"{table}_p{hour.astimezone(UTC):%Y%m%d}"
        with connection.cursor() as cursor:
            cursor.execute("SELECT reloptions FROM pg_class WHERE relname = %s", [name])
            assert cursor.fetchone()[0] == ["fillfactor=70"], table
            cursor.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = %s", [name]
            )
            assert cursor.fetchone() == (1, 1), table  # the second window added to the row: no index touched
            cursor.execute("SELECT indexdef FROM pg_indexes WHERE tablename = %s", [table])
            assert len(cursor.fetchall()) == 3, (
                table
            )  # the primary key, the key's unique index and the start's


def test_housekeeping_makes_partitions_ahead_and_retention_drops_them_whole(clock_at):
    from controlplane.housekeeping import flow_partitions_step, flows_prune_step

    assert flow_partitions_step() >= 3  # at least the days ahead were new
    today = clock.now().astimezone(UTC).date()
    for table in PARTITIONED:
        for offset in range(-1, 4):
            assert exists(f"{table}_p{today + timedelta(days=offset):%Y%m%d}")
    workload, _, _ = enrolled()
    flow_report_ingest(workload_id=str(workload.id), data=at_agent_clock(golden(), clock.now()))
    runtime.facts_set(flow_retention_days=30)
    clock_at(timedelta(days=400))  # everything above is more than 30 days old now
    assert flows_prune_step() > 0
    assert flow_partitions_list() == dict.fromkeys(PARTITIONED, [])
    assert FlowWindow.objects.count() == FlowGroup.objects.count() == EvidenceGap.objects.count() == 0


def test_a_range_read_touches_only_the_partitions_of_its_days():
    from flows.selectors import flow_rollup

    workload, _, _ = enrolled()
    flow_partitions_ahead(now=datetime(2027, 1, 10, tzinfo=UTC))  # 2027-01-09 .. 2027-01-13
    flow_report_ingest(workload_id=str(workload.id), data=at_agent_clock(golden(), clock.now()))  # 01-15
    start, end = datetime(2027, 1, 15, tzinfo=UTC), datetime(2027, 1, 15, 12, tzinfo=UTC)
    rows, _ = flow_rollup(selected=None, group_by=["peer"], start=start, end=end, cursor=None, limit=10)
    assert rows
    query = FlowGroup.objects.filter(start__lt=end, start__gte=start - timedelta(hours=1)).values("peer")
    sql, params = query.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "flows_flowgroup_p20270115" in plan and "flows_flowgroup_p20270110" not in plan, plan

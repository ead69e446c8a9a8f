"""One rollup read (flows.selectors.flow_rollup_read): GET /flows/rollup and `manage.py flows rollup`
plan the range once, and grouped by rule the unused rules come from the rollup's own rows."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta

from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane import clock
from flows.models import FlowGroup, FlowWindow, UnsummedWindow
from flows.partitions import flow_partitions_ensure
from flows.sums.ladder import LADDER
from tests.support.helpers import run_command
from tests.support.workloads import make_workload


def _text(instant: datetime) -> str:
    return instant.strftime("%Y-%m-%dT%H:%M:%SZ")


def _day() -> dict:
    """The last day: whole quarters, hours and blocks, read from the sums."""
    now = clock.now()
    return {"from": _text(now - timedelta(days=1)), "to": _text(now)}


def _rules(api, ports) -> list[dict]:
    rules = [{"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": port}]} for port in ports]
    ruleset = api.post("/api/v1/rulesets", {"name": "web", "scope": "", "rules": rules}, format="json")
    return ruleset.json()["rules"]


def _hit(workload, start: datetime, rule_number: int, connections: int) -> None:
    """A stored minute window with one group that `rule_number` decided (not summed yet)."""
    window = FlowWindow.objects.create(
        id=uuid.uuid4(), workload=workload, start=start, end=start + timedelta(minutes=1), accounting=False,
        received_at=start,
    )  # fmt: skip
    FlowGroup.objects.create(
        window=window, workload=workload, start=start, end=window.end, peer="10.9.9.9", protocol="tcp",
        port=443, decision="allowed", rule_number=rule_number, connection_count=connections,
        first_seen=start, last_seen=start, bytes_in=0, bytes_out=0,
    )  # fmt: skip
    UnsummedWindow.objects.create(window_id=window.id, workload=workload, start=start)


def test_a_rollup_by_rule_reads_the_selections_longest_window_once_and_each_table_of_sums_once(api, db):
    """Before: the rows, the coverage and the unused rules each read the longest window again, and the
    unused rules read the sums a second time."""
    _rules(api, [443])
    with CaptureQueriesContext(connection) as queries:
        page = api.get("/api/v1/flows/rollup", {**_day(), "group_by": "rule"}).json()
    assert page["coverage"]["complete"] is True and len(page["unused_rules"]) == 1
    statements = [query["sql"] for query in queries.captured_queries]
    assert sum("flow_window_seconds_longest" in sql for sql in statements) == 1
    for rung in LADDER:
        assert sum(f'"{rung.table}"' in sql for sql in statements) == 1, rung.table


def test_a_rollup_by_rule_pages_and_names_the_unused_rules_on_every_page(api, db):
    """The rules hit are the rollup's every row, read once, whatever page is asked for."""
    first, second, unused = _rules(api, [443, 8443, 9443])
    workload = make_workload(render=False)
    start = clock.now().replace(second=0, microsecond=0) - timedelta(hours=3)
    flow_partitions_ensure(days={start.date(), clock.now().date()})
    _hit(workload, start, first["number"], 4)
    _hit(workload, start + timedelta(minutes=1), second["number"], 2)
    pages, cursor = [], None
    day = _day()  # once: a cursor holds its query, and the clock's second may tick between pages
    while True:
        query = {**day, "group_by": "rule", "limit": 1, **({"cursor": cursor} if cursor else {})}
        page = api.get("/api/v1/flows/rollup", query).json()
        pages.append(page)
        if not (cursor := page["next_cursor"]):
            break
    assert [[(r["rule_id"], r["connection_count"]) for r in p["items"]] for p in pages] == [
        [(first["id"], 4)],
        [(second["id"], 2)],
    ]
    assert all([r["rule_id"] for r in p["unused_rules"]] == [unused["id"]] for p in pages)
    # The command reads every row at once: the pages' rows and the same unused rules.
    code, out, _ = run_command(
        "flows", "rollup", "--group-by", "rule", "--from", day["from"], "--to", day["to"], "--json"
    )
    document = json.loads(out)
    assert code == 0 and document["next_cursor"] is None
    assert document["items"] == [row for p in pages for row in p["items"]]
    assert document["unused_rules"] == pages[0]["unused_rules"]

"""Bounded keys: a window keeps PALISADE_FLOW_WINDOW_MAX_KEYS keys one by one and a report
PALISADE_FLOW_REPORT_MAX_KEYS; the keys over either bound are summed into the window's aggregate key
of their decision and recorded as a `keys_aggregated` gap with how many keys and connections, never
dropped (in process, SQLite and PostgreSQL)."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from fleet.services import workload_labels_replace
from flows import services
from flows.csv_rows import csv_text, rollup_columns, rollup_row
from flows.models import EvidenceGap, FlowGroup, UnsummedWindow
from flows.services import flow_report_ingest
from flows.sums import writes
from flows.sums.writes import flow_windows_sum
from tests.support.flow_evidence import enrolled, flow_report, windows_between

_uptimes = itertools.count(100)


def _window(minute: int, groups: list[tuple[str, int, str]]) -> dict:
    """A one-minute window `minute` minutes after ten minutes ago, with (peer, connections, decision)
    groups on tcp/443."""
    window = windows_between(clock.now() - timedelta(minutes=10), minute + 1)[minute]
    seen = window["groups"][0]["first_seen"]
    window["groups"] = [
        {"peer": peer, "protocol": "tcp", "port": 443, "decision": decision, "rule": None,
         "connection_count": count, "first_seen": seen, "last_seen": seen, "bytes_in": 0, "bytes_out": 0}
        for peer, count, decision in groups
    ]  # fmt: skip
    return window


def _ingest(workload, windows: list[dict]) -> dict:
    answer = flow_report_ingest(workload_id=str(workload.id), data=flow_report("p1", next(_uptimes), windows))
    assert all(r["result"] == "accepted" for r in answer["windows"]), answer
    return answer


def _stored(window_id: str) -> dict[tuple[str, str], int]:
    return {(g.peer, g.decision): g.connection_count for g in FlowGroup.objects.filter(window_id=window_id)}


def _gaps() -> list[tuple]:
    gaps = EvidenceGap.objects.filter(kind="keys_aggregated")
    return sorted(
        ((gap.kind, gap.start, gap.end, gap.lost, gap.source) for gap in gaps),
        key=lambda gap: (gap[1], sorted(gap[3].items())),
    )


@pytest.fixture
def bounds(settings):
    settings.PALISADE_FLOW_WINDOW_MAX_KEYS = 3
    settings.PALISADE_FLOW_REPORT_MAX_KEYS = 5
    return settings


def test_a_window_keeps_its_heaviest_keys_up_to_the_bound_and_sums_the_rest_per_decision(db, bounds):
    web, _, _ = enrolled()
    groups = [(f"10.1.0.{i}", i, "allowed") for i in range(1, 7)] + [("10.2.0.1", 9, "would_block")]
    window = _window(0, groups)
    _ingest(web, [window])
    # Kept: the three that counted most (9, 6, 5); over the bound: 4, 3, 2, 1 (allowed).
    assert _stored(window["id"]) == {
        ("10.2.0.1", "would_block"): 9, ("10.1.0.6", "allowed"): 6, ("10.1.0.5", "allowed"): 5,
        ("*", "allowed"): 4 + 3 + 2 + 1,
    }  # fmt: skip
    summed = FlowGroup.objects.get(window_id=window["id"], peer="*")
    assert (summed.protocol, summed.port, summed.rule_number, summed.peer_workload_id) == ("*", 0, None, None)
    ((kind, start, end, lost, source),) = _gaps()
    assert (kind, lost, source) == ("keys_aggregated", {"keys": 4, "connections": 10}, None)
    assert (start, end) == (summed.start, summed.end)  # the window's range


def test_a_report_keeps_keys_up_to_its_bound_in_window_order_and_sums_the_rest(db, bounds):
    web, _, _ = enrolled()
    windows = [
        _window(0, [("10.1.0.1", 1, "allowed"), ("10.1.0.2", 2, "allowed"), ("10.1.0.3", 3, "observed")]),
        _window(1, [("10.1.1.1", 1, "allowed"), ("10.1.1.2", 2, "allowed"), ("10.1.1.3", 3, "observed")]),
        _window(2, [("10.1.2.1", 5, "blocked"), ("10.1.2.2", 7, "blocked")]),
    ]
    _ingest(web, windows)
    assert _stored(windows[0]["id"]) == {
        ("10.1.0.1", "allowed"): 1, ("10.1.0.2", "allowed"): 2, ("10.1.0.3", "observed"): 3
    }  # fmt: skip
    # Two keys left of the report's five: the heaviest two; the third window keeps none.
    assert _stored(windows[1]["id"]) == {
        ("10.1.1.3", "observed"): 3, ("10.1.1.2", "allowed"): 2, ("*", "allowed"): 1
    }  # fmt: skip
    assert _stored(windows[2]["id"]) == {("*", "blocked"): 12}
    assert [lost for _, _, _, lost, _ in _gaps()] == [
        {"keys": 1, "connections": 1},
        {"keys": 2, "connections": 12},
    ]
    assert FlowGroup.objects.filter(workload_id=web.id).exclude(peer="*").count() == 5


def test_the_agents_aggregate_key_is_accepted_and_summed_with_what_the_control_plane_sums(db, bounds):
    web, _, _ = enrolled()
    window = _window(0, [(f"10.1.0.{i}", i, "allowed") for i in range(1, 5)] + [("*", 50, "allowed")])
    window["groups"][-1]["protocol"], window["groups"][-1]["port"] = "*", 0
    _ingest(web, [window])
    assert _stored(window["id"]) == {
        ("10.1.0.4", "allowed"): 4, ("10.1.0.3", "allowed"): 3, ("10.1.0.2", "allowed"): 2,
        ("*", "allowed"): 50 + 1,
    }  # fmt: skip
    # The gap says what the control plane summed; the agent's own gap said what it did.
    assert [lost for _, _, _, lost, _ in _gaps()] == [{"keys": 1, "connections": 1}]


def test_a_window_under_the_bounds_records_no_gap_and_a_resent_report_no_second_one(db, bounds):
    web, _, _ = enrolled()
    small = _window(0, [("10.1.0.1", 1, "allowed")])
    large = _window(1, [(f"10.1.1.{i}", 1, "allowed") for i in range(1, 6)])
    report = flow_report("p1", 100.0, [small, large])
    flow_report_ingest(workload_id=str(web.id), data=report)
    flow_report_ingest(workload_id=str(web.id), data=report)  # the acknowledgement was lost
    assert [lost for _, _, _, lost, _ in _gaps()] == [{"keys": 2, "connections": 2}]
    assert FlowGroup.objects.filter(window_id=large["id"]).count() == 3 + 1


@pytest.mark.parametrize(
    "change",
    [
        {"protocol": "tcp"},  # a real protocol with the aggregate's peer
        {"port": 443},
        {"rule": 3},
        {"peer": "10.0.0.1"},  # the aggregate's protocol with an address
    ],
)
def test_an_aggregate_key_that_is_not_exactly_one_is_refused_with_the_reason(db, change):
    web, _, _ = enrolled()
    window = _window(0, [("*", 5, "allowed")])
    window["groups"][0].update({"protocol": "*", "port": 0, **change})
    answer = flow_report_ingest(workload_id=str(web.id), data=flow_report("p1", 100.0, [window]))
    assert answer["windows"][0]["result"] == "refused"
    assert "aggregate key is peer *, protocol *, port 0 and rule null" in answer["windows"][0]["reason"]


def test_the_aggregate_key_reads_as_itself_in_windows_rollups_and_the_peer_filter(api, db, bounds):
    web, _, _ = enrolled()
    window = _window(0, [(f"10.1.0.{i}", i, "would_block") for i in range(1, 6)])
    _ingest(web, [window])
    now = clock.now()
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    span = {"from": text(now - timedelta(hours=1)), "to": text(now + timedelta(hours=1))}
    page = api.get("/api/v1/flows", {**span, "workload": str(web.id), "peer": "*"}).json()
    ((group,),) = [w["groups"] for w in page["items"]]
    assert (group["peer"], group["protocol"], group["port"], group["rule_number"]) == ("*", "*", 0, None)
    assert (group["decision"], group["connection_count"], group["peer_workload_id"]) == (
        "would_block",
        1 + 2,
        None,
    )
    for _ in range(2):  # before summing and after: the same rows
        rows = api.get("/api/v1/flows/rollup", {**span, "group_by": ["peer", "service"]}).json()["items"]
        assert [(r["peer"], r["service"], r["connection_count"]) for r in rows] == [
            ("*", {"protocol": "*", "port": 0}, 1 + 2),
            ("10.1.0.3", {"protocol": "tcp", "port": 443}, 3),
            ("10.1.0.4", {"protocol": "tcp", "port": 443}, 4),
            ("10.1.0.5", {"protocol": "tcp", "port": 443}, 5),
        ]
        flow_windows_sum(before=now + timedelta(hours=1))
    csv = csv_text(rollup_columns(["peer", "service"]), [rollup_row(row) for row in rows])
    assert csv.splitlines()[:2] == ["peer,protocol,port,connection_count,bytes_in,bytes_out,first_seen,last_seen",
                                    f"*,*,0,3,0,0,{rows[0]['first_seen']},{rows[0]['last_seen']}"]  # fmt: skip
    review = api.get("/api/v1/flows/review", {**span, "workload": str(web.id)}).json()
    assert review["verdict"] == "fail" and review["would_block_count"] == 3 + 1
    assert sum(row["connection_count"] for row in review["would_block"]) == 1 + 2 + 3 + 4 + 5
    assert ("*", {"protocol": "*", "port": 0}, 1 + 2) in [
        (row["peer"], row["service"], row["connection_count"]) for row in review["would_block"]
    ]
    assert "keys_aggregated" in {gap["kind"] for gap in review["coverage"]["gaps"]}


def test_summing_takes_windows_up_to_a_number_of_groups_per_transaction(db, bounds, monkeypatch):
    web, _, _ = enrolled()
    windows = [_window(i, [(f"10.1.{i}.{k}", 1, "allowed") for k in range(2)]) for i in range(4)]
    for window in windows:
        _ingest(web, [window])
    assert sorted(UnsummedWindow.objects.values_list("keys", flat=True)) == [2, 2, 2, 2]
    monkeypatch.setitem(writes.GROUPS_PER_SUM, connection.vendor, 5)  # two windows' groups at most
    with CaptureQueriesContext(connection) as queries:
        assert flow_windows_sum(before=clock.now() + timedelta(hours=1)) == 4
    taken = [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].startswith('DELETE FROM "flows_unsummedwindow"')
    ]
    assert len(taken) == 2  # two transactions of two windows each
    assert not UnsummedWindow.objects.exists()


def test_a_round_of_summing_ends_after_its_time_and_the_next_takes_the_rest(db, bounds, monkeypatch):
    web, _, _ = enrolled()
    for i in range(4):
        _ingest(web, [_window(i, [(f"10.1.{i}.{k}", 1, "allowed") for k in range(2)])])
    monkeypatch.setitem(writes.GROUPS_PER_SUM, connection.vendor, 5)
    assert flow_windows_sum(before=clock.now() + timedelta(hours=1), seconds=0) == 2  # one transaction
    assert UnsummedWindow.objects.count() == 2
    assert flow_windows_sum(before=clock.now() + timedelta(hours=1)) == 2
    assert not UnsummedWindow.objects.exists()


def test_each_direction_has_its_own_bound_in_a_window_a_report_and_a_minute_sent_again(db, bounds):
    web, _, _ = enrolled()
    window = _window(0, [(f"10.1.0.{i}", i, "allowed") for i in range(1, 4)])
    outgoing = [{**window["groups"][0], "peer": f"198.51.100.{i}", "decision": "observed", "direction": "outbound",
                 "connection_count": 1} for i in range(1, 6)]  # fmt: skip
    window["groups"] += outgoing
    _ingest(web, [window])
    # Three inbound keys, the bound: all kept as they are, the outbound ones past three summed apart.
    stored = {
        (g.peer, g.direction): g.connection_count for g in FlowGroup.objects.filter(window_id=window["id"])
    }
    assert {key: n for key, n in stored.items() if key[1] == "inbound"} == {
        ("10.1.0.1", "inbound"): 1, ("10.1.0.2", "inbound"): 2, ("10.1.0.3", "inbound"): 3
    }  # fmt: skip
    assert stored[("*", "outbound")] == 2 and sum(1 for k in stored if k[1] == "outbound") == 4
    assert [lost for _, _, _, lost, _ in _gaps()] == [{"keys": 2, "connections": 2}]
    # The same minute again under a new id: the outbound bound is used up, the inbound one too; an
    # outbound key is summed, not an inbound one in its place.
    again = _window(0, [])
    again["groups"] = [{**outgoing[0], "peer": "198.51.100.9"}]
    _ingest(web, [again])
    assert {(g.peer, g.direction) for g in FlowGroup.objects.filter(window_id=again["id"])} == {
        ("*", "outbound")
    }


def test_windows_sent_again_under_new_ids_for_the_same_minute_add_no_keys_past_the_bound(db, bounds):
    web, _, _ = enrolled()
    first = _window(0, [("10.1.0.1", 1, "allowed"), ("10.1.0.2", 2, "allowed")])
    again = _window(0, [("10.1.0.3", 3, "allowed"), ("10.1.0.4", 4, "allowed"), ("10.1.0.5", 5, "observed")])
    _ingest(web, [first])
    _ingest(web, [again])  # the same minute, another id: one key of the bound of three is left
    assert _stored(again["id"]) == {("10.1.0.5", "observed"): 5, ("*", "allowed"): 3 + 4}
    third = _window(0, [("10.1.0.6", 6, "blocked")])
    _ingest(web, [third])
    assert _stored(third["id"]) == {("*", "blocked"): 6}
    assert [lost for _, _, _, lost, _ in _gaps()] == [
        {"keys": 1, "connections": 6},
        {"keys": 2, "connections": 7},
    ]
    minute = FlowGroup.objects.get(window_id=first["id"], peer="10.1.0.1").start
    assert FlowGroup.objects.filter(workload_id=web.id, start=minute).exclude(peer="*").count() == 3


def test_the_aggregate_key_is_never_a_suggested_rule_nor_a_key_the_impact_judges(api, db, bounds):
    enrolled_web, _, _ = enrolled()
    web = workload_labels_replace(
        actor=CLI_ACTOR, workload_id=str(enrolled_web.id), expected_version=str(enrolled_web.labels_version),
        data={"labels": {"app": "web"}},
    )  # fmt: skip
    window = _window(0, [(f"10.1.0.{i}", i, "observed") for i in range(1, 6)])
    _ingest(web, [window])
    now = clock.now()
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    span = {"from": text(now - timedelta(hours=1)), "to": text(now + timedelta(hours=1))}
    suggested = api.post("/api/v1/policies/suggestions", {**span, "workload": [str(web.id)]}, format="json")
    assert suggested.status_code == 200, suggested.content
    proposed = suggested.json()
    assert "*" not in str(proposed["rulesets"]) and "*" not in str(proposed["address_groups"])
    assert all(k["peer"] != "*" for k in proposed["not_generalised"])
    draft = {"rulesets": [{"name": "web", "scope": "app=web", "rules": [
        {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 443}]}]}]}  # fmt: skip
    impact = api.post("/api/v1/policies/impact", {**draft, **span}, format="json")
    assert impact.status_code == 200, impact.content
    judged = impact.json()
    assert all(e["peer"] != "*" for e in judged["newly_refused"] + judged["newly_admitted"])
    assert judged["keys_classified"] == 3  # the three keys kept, not the aggregate one


def test_pruning_deletes_in_statements_of_a_bounded_number_of_rows(db, monkeypatch):
    web, _, _ = enrolled()
    for i in range(3):
        _ingest(web, [_window(i, [(f"10.1.{i}.{k}", 1, "allowed") for k in range(3)])])
    monkeypatch.setattr(services, "PRUNE_ROWS_PER_STATEMENT", 2)
    with CaptureQueriesContext(connection) as queries:
        # Everything is older, yet no window's day partition goes whole (a day later it would, just
        # after midnight, when the ten-minute-old windows are yesterday's): their rows are what counts.
        pruned = services.flow_evidence_prune(older_than=-timedelta(hours=23))
    assert pruned.rows == 3 and not FlowGroup.objects.exists()
    by_age = [
        q["sql"] for q in queries.captured_queries if q["sql"].startswith('DELETE FROM "flows_flowgroup"')
    ]
    if connection.vendor == "postgresql":
        assert len([sql for sql in by_age if '"end" <' in sql]) == 1  # at once: its partitions go whole
    else:
        assert (
            len([sql for sql in by_age if '"flows_flowgroup"."id" IN' in sql]) == 5
        )  # 9 groups, 2 a statement


@given(
    keys=st.lists(
        st.tuples(st.sampled_from(["inbound", "outbound"]), st.booleans(), st.integers(1, 9)), max_size=12
    ),
    inbound=st.integers(0, 6),
    outbound=st.integers(0, 6),
)
@hypothesis_settings(max_examples=300, deadline=None)
def test_the_counted_fold_returns_what_the_fold_and_its_count_return(keys, inbound, outbound):
    """`keys_fold_counted` skips the fold within the bound (counting once): it must return what
    `keys_fold` and `keys_by_direction` return, at the bound, under it and over it, aggregate keys
    among the keys or not."""
    from flows.choices import AGGREGATE
    from flows.reports import keys_by_direction, keys_fold, keys_fold_counted

    seen = clock.now()
    groups = [
        {"peer": AGGREGATE if aggregate else f"10.0.0.{i}", "protocol": AGGREGATE if aggregate else "tcp",
         "port": 0 if aggregate else 443, "decision": "allowed", "rule_number": None, "direction": direction,
         "failsafe": False, "connection_count": count, "first_seen": seen, "last_seen": seen,
         "bytes_in": 0, "bytes_out": 0}
        for i, (direction, aggregate, count) in enumerate(keys)
    ]  # fmt: skip
    keep = {"inbound": inbound, "outbound": outbound}
    folded, summed = keys_fold([dict(g) for g in groups], keep=keep)
    assert keys_fold_counted(groups, keep=keep) == (folded, summed, keys_by_direction(folded))

"""Outbound evidence in the reads: every flow read takes `direction` (inbound by default, outbound,
any) through the one selection parser, and the inbound answers of a workload that also records
outbound connections are those of a workload that never did (the same inbound evidence, stored and
summed alike)."""

from __future__ import annotations

import json
import re
import uuid
from datetime import timedelta

import pytest

from agent.flowbuffer import window_record
from agent.flowreport import report_body
from agent.flowwindow import FlowKey, Windows
from controlplane import clock
from flows.models import FlowGroup, FlowHour
from flows.services import flow_report_ingest
from flows.sums.writes import flow_windows_sum
from tests.support.flow_evidence import GOLDEN, at_agent_clock, enrolled, flow_report
from tests.support.helpers import run_command

MINUTES = 40
INBOUND = [
    {"peer": "10.9.9.9", "protocol": "tcp", "port": 443, "decision": "allowed", "rule": 7, "connection_count": 3},
    {"peer": "192.0.2.7", "protocol": "tcp", "port": 22, "decision": "would_block", "rule": None, "connection_count": 2},
]  # fmt: skip
OUTBOUND = [
    # The same peer and service as an inbound key: a key of its own.
    {"peer": "10.9.9.9", "protocol": "tcp", "port": 443, "decision": "allowed", "rule": 7, "connection_count": 5,
     "direction": "outbound"},
    {"peer": "198.51.100.4", "protocol": "tcp", "port": 9090, "decision": "would_block", "rule": None,
     "connection_count": 4, "direction": "outbound"},
    {"peer": "198.51.100.53", "protocol": "udp", "port": 53, "decision": "allowed", "rule": None,
     "connection_count": 6, "direction": "outbound", "failsafe": True},
]  # fmt: skip


def _text(instant) -> str:
    return instant.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _windows(start, groups: list[dict]) -> list[dict]:
    return [
        {
            "id": str(uuid.uuid4()),
            "start": _text(start + timedelta(minutes=i)),
            "end": _text(start + timedelta(minutes=i + 1)),
            "policy_version": "v",
            "accounting": False,
            "groups": [
                {**g, "first_seen": _text(start + timedelta(minutes=i, seconds=1)),
                 "last_seen": _text(start + timedelta(minutes=i, seconds=2)), "bytes_in": 0, "bytes_out": 0}
                for g in groups
            ],
        }
        for i in range(MINUTES)
    ]  # fmt: skip


@pytest.fixture
def two_fleets(db):
    """`both` records inbound and outbound connections in the same windows; `inbound_only` the same
    inbound ones and nothing else. Half the windows summed, so the reads take both paths."""
    start = (clock.now() - timedelta(hours=2)).replace(second=0, microsecond=0)
    both, _, _ = enrolled("both", "10.50.0.1")
    inbound_only, _, _ = enrolled("inbound-only", "10.50.0.2")
    for workload, groups in ((both, INBOUND + OUTBOUND), (inbound_only, INBOUND)):
        answer = flow_report_ingest(
            workload_id=str(workload.id), data=flow_report("p", 100.0, _windows(start, groups))
        )
        assert {item["result"] for item in answer["windows"]} == {"accepted"}
    flow_windows_sum(before=start + timedelta(minutes=MINUTES // 2))
    assert FlowHour.objects.filter(direction="outbound").exists()
    return both, inbound_only, start


def _same(document, both, inbound_only) -> str:
    """A document with the two workloads' ids and hostnames made one, and window ids and the instant
    of the retention (now, at each read) left out."""
    text = re.sub(r'"(retained_from|mode_since)": "[^"]*"', r'"\1": 0', json.dumps(document, sort_keys=True))
    text = text.replace(str(both.id), "W").replace(str(inbound_only.id), "W").replace("inbound-only", "H")
    parsed = json.loads(text.replace('"both"', '"H"'))
    for window in parsed.get("items", []) if isinstance(parsed, dict) else []:
        if isinstance(window, dict) and "groups" in window:
            window.pop("id"), window.pop("received_at")
    return json.dumps(parsed, sort_keys=True)


def _range(start) -> dict:
    return {"from": _text(start - timedelta(minutes=7)), "to": _text(start + timedelta(minutes=MINUTES + 3))}


READS = [
    ("/api/v1/flows/rollup", {"group_by": ["peer", "service", "decision", "rule"]}),
    ("/api/v1/flows/rollup", {"group_by": ["window", "decision"]}),
    ("/api/v1/flows/rollup", {"group_by": ["rule"]}),
    ("/api/v1/flows/rollup", {"group_by": ["peer_workload", "ruleset"]}),
    ("/api/v1/flows/review", {}),
    ("/api/v1/flows/gaps", {}),
]


@pytest.mark.parametrize("path, params", READS)
def test_the_inbound_answers_are_those_of_a_workload_that_never_recorded_outbound(
    api, two_fleets, path, params
):
    both, inbound_only, start = two_fleets
    answers = [
        api.get(path, {**_range(start), **params, "workload": str(w.id), **extra})
        for w in (both, inbound_only)
        for extra in ({}, {"direction": "inbound"})
    ]
    assert {a.status_code for a in answers} == {200}
    same = [_same(a.json(), both, inbound_only) for a in answers]
    assert same[1:] == same[:1] * 3


def test_the_flows_list_and_the_csv_of_inbound_are_unchanged(api, two_fleets):
    both, inbound_only, start = two_fleets
    pages = [
        api.get("/api/v1/flows", {**_range(start), "workload": str(w.id), "limit": 500}).json()
        for w in (both, inbound_only)
    ]
    assert len(pages[0]["items"]) == MINUTES
    assert _same(pages[0], both, inbound_only) == _same(pages[1], both, inbound_only)
    assert all("direction" not in g for w in pages[0]["items"] for g in w["groups"])
    csvs = [
        run_command("flows", "rollup", "--workload", str(w.id), "--group-by", "peer", "--group-by", "service",
                    "--from", _range(start)["from"], "--to", _range(start)["to"], "--csv")[1]
        for w in (both, inbound_only)
    ]  # fmt: skip
    assert csvs[0] == csvs[1] and "10.9.9.9,tcp,443,120" in csvs[0]


def test_outbound_and_any_read_the_outbound_keys(api, two_fleets):
    both, _, start = two_fleets
    read = {**_range(start), "workload": str(both.id)}
    rollup = api.get(
        "/api/v1/flows/rollup", {**read, "direction": "outbound", "group_by": ["peer", "service", "decision"]}
    ).json()
    counts = {
        (r["peer"], r["service"]["port"], r["decision"]): r["connection_count"] for r in rollup["items"]
    }
    assert counts == {
        ("10.9.9.9", 443, "allowed"): 5 * MINUTES,
        ("198.51.100.4", 9090, "would_block"): 4 * MINUTES,
        ("198.51.100.53", 53, "allowed"): 6 * MINUTES,
    }
    split = api.get(
        "/api/v1/flows/rollup", {**read, "direction": "any", "group_by": ["direction", "peer"]}
    ).json()
    counts = {(r["direction"], r["peer"]): r["connection_count"] for r in split["items"]}
    assert counts[("inbound", "10.9.9.9")] == 3 * MINUTES and counts[("outbound", "10.9.9.9")] == 5 * MINUTES
    summed = api.get("/api/v1/flows/rollup", {**read, "direction": "any", "group_by": ["peer"]}).json()
    assert {r["peer"]: r["connection_count"] for r in summed["items"]}["10.9.9.9"] == 8 * MINUTES

    page = api.get("/api/v1/flows", {**read, "direction": "outbound", "limit": 1}).json()
    groups = {g["peer"]: g for g in page["items"][0]["groups"]}
    assert set(groups) == {"10.9.9.9", "198.51.100.4", "198.51.100.53"}
    assert groups["198.51.100.53"]["failsafe"] is True and groups["198.51.100.53"]["rule_number"] is None
    assert {g["direction"] for g in groups.values()} == {"outbound"}

    review = api.get("/api/v1/flows/review", {**read, "direction": "outbound"}).json()
    assert [(r["peer"], r["connection_count"]) for r in review["would_block"]] == [
        ("198.51.100.4", 4 * MINUTES)
    ]
    review = api.get("/api/v1/flows/review", {**read, "direction": "any"}).json()
    assert {(r["peer"], r["direction"]) for r in review["would_block"]} == {
        ("198.51.100.4", "outbound"), ("192.0.2.7", "inbound"),
    }  # fmt: skip


def test_rule_hits_and_unused_rules_follow_the_direction(api, two_fleets):
    both, _, start = two_fleets
    read = {**_range(start), "workload": str(both.id), "group_by": ["rule"]}
    hits = {
        direction: {
            r["rule_number"]: r["connection_count"]
            for r in api.get("/api/v1/flows/rollup", {**read, "direction": direction}).json()["items"]
        }
        for direction in ("inbound", "outbound", "any")
    }
    assert hits["inbound"] == {7: 3 * MINUTES, None: 2 * MINUTES}
    assert hits["outbound"] == {7: 5 * MINUTES, None: 10 * MINUTES}
    assert hits["any"] == {7: 8 * MINUTES, None: 12 * MINUTES}


@pytest.mark.parametrize(
    "path", ["/api/v1/flows", "/api/v1/flows/rollup", "/api/v1/flows/review", "/api/v1/flows/gaps"]
)
def test_a_direction_that_is_none_of_the_three_is_a_validation_problem(api, two_fleets, path):
    both, _, start = two_fleets
    answer = api.get(
        path, {**_range(start), "workload": str(both.id), "group_by": "peer", "direction": "out"}
    )
    assert answer.status_code == 422
    assert [e["path"] for e in answer.json()["errors"]] == ["?direction"]


def test_a_report_key_is_checked_for_direction_and_failsafe(db):
    workload, _, _ = enrolled()
    start = (clock.now() - timedelta(hours=1)).replace(second=0, microsecond=0)
    bad = [
        {**INBOUND[0], "direction": "sideways"},
        {**INBOUND[0], "direction": 1},
        {**INBOUND[0], "failsafe": "yes"},
        {**INBOUND[0], "failsafe": True},  # allowed by rule 7: not the fail-safe list's
        {**INBOUND[1], "failsafe": True},  # would_block
    ]
    windows = [_windows(start + timedelta(hours=0, minutes=i * MINUTES), [g])[0] for i, g in enumerate(bad)]
    answer = flow_report_ingest(workload_id=str(workload.id), data=flow_report("p", 1.0, windows))
    assert [item["result"] for item in answer["windows"]] == ["refused"] * len(bad)
    assert FlowGroup.objects.count() == 0


def test_the_flows_list_of_any_holds_both_directions_groups(api, two_fleets):
    both, _, start = two_fleets
    read = {**_range(start), "workload": str(both.id), "limit": 500}
    sizes = {
        direction: sum(
            len(w["groups"])
            for w in api.get("/api/v1/flows", {**read, "direction": direction}).json()["items"]
        )
        for direction in ("inbound", "outbound", "any")
    }
    assert sizes == {"inbound": 2 * MINUTES, "outbound": 3 * MINUTES, "any": 5 * MINUTES}


GOLDEN_OUTBOUND = GOLDEN.with_name("flow_report_outbound.json")
T0 = 1_800_000_000.0


def _outbound_report_body() -> bytes:
    """What the agent writes for a window of an inbound key, an outbound one and a fail-safe one."""
    windows = Windows(length=60, max_keys=100, accounting=True)
    windows.connection_opened(FlowKey("10.50.0.2", "tcp", 443, "allowed", 7), T0 + 1)
    windows.connection_opened(FlowKey("192.0.2.9", "tcp", 5432, "allowed", 12, "outbound"), T0 + 2)
    windows.connection_opened(FlowKey("192.0.2.9", "tcp", 9090, "blocked", None, "outbound"), T0 + 3)
    windows.connection_opened(FlowKey("192.0.2.53", "udp", 53, "allowed", None, "outbound", True), T0 + 4)
    (closed,), _ = windows.close_due(T0 + 60, "sha256:aa")
    record = {**window_record(closed), "id": "6f8a3c1e-2b4d-4e5f-8a9b-0c1d2e3f4a5c"}
    return report_body(
        [record], [], now=T0 + 61, process_start_id="9b2f6c1e", uptime_seconds=3600.25, window_seconds=60
    )


def test_the_outbound_golden_report_is_what_the_agent_writes_and_what_the_gateway_stores(db):
    body = _outbound_report_body()
    assert body + b"\n" == GOLDEN_OUTBOUND.read_bytes()
    workload, _, _ = enrolled()
    answer = flow_report_ingest(
        workload_id=str(workload.id), data=at_agent_clock(json.loads(body), clock.now())
    )
    assert [r["result"] for r in answer["windows"]] == ["accepted"]
    stored = set(
        FlowGroup.objects.values_list("peer", "port", "decision", "rule_number", "direction", "failsafe")
    )
    assert stored == {
        ("10.50.0.2", 443, "allowed", 7, "inbound", False),
        ("192.0.2.9", 5432, "allowed", 12, "outbound", False),
        ("192.0.2.9", 9090, "blocked", None, "outbound", False),
        ("192.0.2.53", 53, "allowed", None, "outbound", True),
    }

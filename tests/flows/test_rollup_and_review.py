"""Rollups with their coverage, rule hits and unused rules, and the simulation review's verdict."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta

from controlplane import clock
from flows.services import flow_report_ingest
from tests.support.flow_evidence import enrolled, flow_report, windows_between
from tests.support.helpers import assert_problem


def _range():
    now = clock.now()
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    return {"from": text(now - timedelta(hours=1)), "to": text(now + timedelta(hours=1))}


def _short_range():
    """Five minutes around the window `_windows` makes: under a ten-minute block, so a rollup reads
    the minute rows, not the sums."""
    window_start = datetime.fromisoformat(
        windows_between(clock.now() - timedelta(minutes=10), 1)[0]["start"].replace("Z", "+00:00")
    )
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    return {
        "from": text(window_start - timedelta(minutes=1)),
        "to": text(window_start + timedelta(minutes=4)),
    }


_uptimes = itertools.count(100)  # each report later than the one before: a repeat moves no liveness


def _ingest(workload, windows, gaps=()):
    report = flow_report("p1", next(_uptimes), windows)
    report["gaps"] = list(gaps)
    answer = flow_report_ingest(workload_id=str(workload.id), data=report)
    assert all(r["result"] == "accepted" for r in answer["windows"] + answer["gaps"]), answer


def _windows(workload, groups):
    windows = windows_between(clock.now() - timedelta(minutes=10), 1)
    windows[0]["groups"] = [{**windows[0]["groups"][0], **group} for group in groups]
    return windows


def test_rollup_sums_by_the_keys_asked_for_and_states_its_coverage(api, db):
    web, _, _ = enrolled("web", "10.50.0.1")
    db_host, _, _ = enrolled("db", "10.50.0.2")
    _ingest(web, _windows(web, [
        {"peer": "10.50.0.2", "port": 443, "decision": "allowed", "connection_count": 3},
        {"peer": "10.9.9.9", "port": 22, "decision": "would_block", "connection_count": 2},
    ]))  # fmt: skip
    page = api.get("/api/v1/flows/rollup", {**_range(), "group_by": ["peer", "decision"]}).json()
    assert [(r["peer"], r["decision"], r["connection_count"]) for r in page["items"]] == [
        ("10.50.0.2", "allowed", 3),
        ("10.9.9.9", "would_block", 2),
    ]
    assert set(page["items"][0]) == {
        "peer",
        "decision",
        "connection_count",
        "bytes_in",
        "bytes_out",
        "first_seen",
        "last_seen",
    }
    # db sent nothing: no total reads as complete.
    assert page["coverage"]["complete"] is False
    assert page["coverage"]["workloads_without_reports"] == [str(db_host.id)]
    only_web = api.get(
        "/api/v1/flows/rollup", {**_range(), "group_by": "peer_workload", "workload": str(web.id)}
    ).json()
    assert only_web["coverage"]["complete"] is True
    assert {r["peer_workload_id"] for r in only_web["items"]} == {str(db_host.id), None}
    span = _range()  # one range for every page: a cursor belongs to its query
    first = api.get("/api/v1/flows/rollup", {**span, "group_by": "peer", "limit": 1}).json()
    rest = api.get(
        "/api/v1/flows/rollup", {**span, "group_by": "peer", "limit": 1, "cursor": first["next_cursor"]}
    ).json()
    assert [r["peer"] for r in first["items"] + rest["items"]] == ["10.50.0.2", "10.9.9.9"] and rest[
        "next_cursor"
    ] is None
    assert_problem(api.get("/api/v1/flows/rollup", {**_range(), "group_by": "colour"}), 422, "validation")
    assert_problem(api.get("/api/v1/flows/rollup", _range()), 422, "validation")


def test_rule_hits_and_unused_rules_only_when_the_range_is_covered(api, db):
    web, _, _ = enrolled("web", "10.50.0.1")
    ruleset = api.post(
        "/api/v1/rulesets",
        {"name": "web", "scope": "", "rules": [
            {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 443}]},
            {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 8443}]},
        ]},
        format="json",
    ).json()  # fmt: skip
    used, unused = ruleset["rules"]
    _ingest(
        web,
        _windows(web, [{"port": 443, "decision": "allowed", "rule": used["number"], "connection_count": 4}]),
    )
    page = api.get("/api/v1/flows/rollup", {**_range(), "group_by": "rule", "workload": str(web.id)}).json()
    assert [(r["rule_id"], r["connection_count"]) for r in page["items"]] == [(used["id"], 4)]
    assert [r["rule_id"] for r in page["unused_rules"]] == [unused["id"]]
    # The command's --json is the same document.
    import json

    from tests.support.helpers import run_command

    window = ("--from", _range()["from"], "--to", _range()["to"])
    code, out, _ = run_command(
        "flows", "rollup", "--group-by", "rule", "--workload", str(web.id), *window, "--json"
    )
    document = json.loads(out)
    assert code == 0 and document["unused_rules"] == page["unused_rules"] and document["next_cursor"] is None
    assert document["items"] == page["items"]
    # A range under a ten-minute block reads the minute rows, not the sums: the same answer.
    short = _short_range()
    page = api.get("/api/v1/flows/rollup", {**short, "group_by": "rule", "workload": str(web.id)}).json()
    assert page["coverage"]["complete"] is True
    assert [r["rule_id"] for r in page["unused_rules"]] == [unused["id"]]
    # A gap in the range: a rule without hits may only have gone unseen.
    gap = {"id": "8c1d2e3f-4a5b-4c6d-8e7f-9a0b1c2d3e4f", "kind": "source_restart", "source": "conntrack",
           "start": windows_between(clock.now() - timedelta(minutes=5), 1)[0]["start"],
           "end": windows_between(clock.now() - timedelta(minutes=4), 1)[0]["start"], "lost": {}}  # fmt: skip
    _ingest(web, [], [gap])
    page = api.get("/api/v1/flows/rollup", {**_range(), "group_by": "rule", "workload": str(web.id)}).json()
    assert page["coverage"]["complete"] is False and page["unused_rules"] is None


def test_grouped_by_ruleset_the_rollup_pages_and_names_rulesets_by_their_ids(api, db):
    """A range of whole blocks reads the sums (a UNION of subqueries): each ruleset id as /rulesets
    gives it, and the second page reached by the cursor."""
    web, _, _ = enrolled("web", "10.50.0.1")
    rulesets = [
        api.post(
            "/api/v1/rulesets",
            {"name": name, "scope": "", "rules": [{"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": port}]}]},
            format="json",
        ).json()
        for name, port in (("web", 443), ("admin", 22))
    ]  # fmt: skip
    _ingest(web, _windows(web, [
        {"port": 443, "decision": "allowed", "rule": rulesets[0]["rules"][0]["number"], "connection_count": 4},
        {"port": 22, "decision": "allowed", "rule": rulesets[1]["rules"][0]["number"], "connection_count": 2},
        {"port": 9, "decision": "would_block", "connection_count": 1},
    ]))  # fmt: skip
    span = _range()  # two hours: whole blocks
    pages, cursor = [], None
    while True:
        params = {**span, "group_by": "ruleset", "limit": 1, **({"cursor": cursor} if cursor else {})}
        response = api.get("/api/v1/flows/rollup", params)
        assert response.status_code == 200, response.content
        pages.append(response.json()["items"])
        cursor = response.json()["next_cursor"]
        if cursor is None:
            break
    counts = {row["ruleset_id"]: row["connection_count"] for page in pages for row in page}
    assert counts == {rulesets[0]["id"]: 4, rulesets[1]["id"]: 2, None: 1}
    assert len(pages) == 3
    # A range under a block reads the minute rows: the same ids.
    short = _short_range()
    rows = api.get("/api/v1/flows/rollup", {**short, "group_by": "ruleset"}).json()["items"]
    assert {row["ruleset_id"]: row["connection_count"] for row in rows} == counts


def test_the_review_passes_only_with_nothing_to_fear(api, db, clock_at):
    web, _, _ = enrolled("web", "10.50.0.1")
    api.post(
        "/api/v1/mode-changes",
        {"selection": {"workload_ids": [str(web.id)]}, "mode": "simulation"},
        format="json",
    )
    # In simulation only since just now: a range that began an hour ago was not all simulated.
    review = api.get("/api/v1/flows/review", {**_range(), "workload": str(web.id)}).json()
    (elsewhere,) = review["not_in_simulation"]
    assert elsewhere["mode"] == "simulation" and elsewhere["mode_since"] > _range()["from"]
    assert "1 workload was not in simulation for the whole range" in review["reasons"]
    clock_at(timedelta(hours=2))  # now the whole range lies after the mode change
    _ingest(web, _windows(web, [{"port": 443, "decision": "allowed", "connection_count": 1}]))
    review = api.get("/api/v1/flows/review", {**_range(), "workload": str(web.id)}).json()
    # Never connected: offline, and that alone fails the review.
    assert review["verdict"] == "fail" and [w["workload_id"] for w in review["offline"]] == [str(web.id)]
    from fleet.models import Workload

    Workload.objects.filter(id=web.id).update(sync_state="synced")
    review = api.get("/api/v1/flows/review", {**_range(), "workload": str(web.id)}).json()
    assert review["verdict"] == "pass" and review["reasons"] == []
    _ingest(
        web,
        _windows(web, [{"peer": "10.7.7.7", "port": 5432, "decision": "would_block", "connection_count": 9}]),
    )
    review = api.get("/api/v1/flows/review", {**_range(), "workload": str(web.id)}).json()
    assert review["verdict"] == "fail"
    assert review["would_block"] == [
        {
            "workload_id": str(web.id),
            "peer": "10.7.7.7",
            "service": {"protocol": "tcp", "port": 5432},
            "connection_count": 9,
            "rule_number": None,
            "rule_id": None,
            "rule_action": None,
        }
    ]


def test_the_flows_command_rolls_up_and_reviews(db):
    import csv
    import io
    import json

    from tests.support.helpers import run_command

    web, _, _ = enrolled("web", "10.50.0.1")
    _ingest(
        web,
        _windows(web, [{"peer": "10.7.7.7", "port": 5432, "decision": "would_block", "connection_count": 9}]),
    )
    window = ("--from", _range()["from"], "--to", _range()["to"])
    code, out, _ = run_command(
        "flows", "rollup", "--group-by", "service", "--group-by", "decision", *window, "--csv"
    )
    assert code == 0
    assert [
        (r["protocol"], r["port"], r["decision"], r["connection_count"])
        for r in csv.DictReader(io.StringIO(out))
    ] == [("tcp", "5432", "would_block", "9")]
    assert (
        out.splitlines()[0]
        == "protocol,port,decision,connection_count,bytes_in,bytes_out,first_seen,last_seen"
    )
    code, out, _ = run_command("flows", "rollup", "--group-by", "service", *window, "--json")
    assert json.loads(out)["items"][0]["service"] == {"protocol": "tcp", "port": 5432}
    empty = ("--from", "2026-01-01T00:00:00Z", "--to", "2026-01-01T01:00:00Z")
    code, out, err = run_command(
        "flows", "rollup", "--group-by", "peer", "--group-by", "rule", *empty, "--csv"
    )
    assert (code, out.strip()) == (
        0,
        "peer,rule_number,rule_id,rule_action," + "connection_count,bytes_in,bytes_out,first_seen,last_seen",
    )
    assert "incomplete: 0 gaps, 1 workload sent no window in the range" in err
    assert "evidence before " in err and " removed" in err  # January lies before the retention
    code, out, _ = run_command("flows", "rollup", "--group-by", "peer", *empty)
    assert out.splitlines()[0] == "no flows in the range" and out.splitlines()[1].startswith("incomplete:")
    code, out, _ = run_command("flows", "review", *window, "--json")
    assert code == 3 and json.loads(out)["verdict"] == "fail"  # a pipeline gates on the status
    code, out, _ = run_command("flows", "review", *window)
    assert code == 3 and out.startswith("FAIL (judged on the decisions recorded in the range)")
    assert "would-block" in out and "against the policy in force now" in out
    code, _, err = run_command("flows", "rollup", "--group-by", "peer", *window, "--csv", "--json")
    assert code == 1 and err.strip() == "error: --csv and --json each choose the output: give one"


def test_rollup_pages_by_key_so_groups_arriving_while_paging_shift_nothing(api, db):
    """The cursor holds the last key of the page: a group that appears before it while a client pages
    is not seen (it sorts before), and no group is repeated or skipped. Both read paths: whole hours
    from the hourly sums (grouped by peer) and the minute rows (grouped by peer and window)."""

    def peers(*addresses):
        return [{"peer": a, "port": 443, "decision": "allowed", "connection_count": 1} for a in addresses]

    for index, group_by in enumerate((["peer"], ["peer", "window"])):
        web, _, _ = enrolled(f"web-{index}", f"10.50.0.{index + 1}")
        query = {**_range(), "group_by": group_by, "limit": 2, "workload": str(web.id)}
        _ingest(web, _windows(web, peers("10.1.0.1", "10.1.0.3", "10.1.0.5")))
        first = api.get("/api/v1/flows/rollup", query).json()
        assert [r["peer"] for r in first["items"]] == ["10.1.0.1", "10.1.0.3"]
        _ingest(web, _windows(web, peers("10.1.0.2", "10.1.0.4")))  # one before the cursor, one after
        rest = api.get("/api/v1/flows/rollup", {**query, "cursor": first["next_cursor"]}).json()
        assert [r["peer"] for r in rest["items"]] == ["10.1.0.4", "10.1.0.5"], group_by
        assert rest["next_cursor"] is None


def test_rollup_pages_put_groups_without_a_rule_last(api, db):
    web, _, _ = enrolled("web", "10.50.0.1")
    _ingest(web, _windows(web, [
        {"peer": "10.1.0.1", "port": 443, "decision": "would_block", "rule": None, "connection_count": 1},
        {"peer": "10.1.0.2", "port": 443, "decision": "allowed", "rule": 9, "connection_count": 1},
        {"peer": "10.1.0.3", "port": 443, "decision": "allowed", "rule": 7, "connection_count": 1},
    ]))  # fmt: skip
    span = _range()  # one range for every page: a cursor belongs to its query
    for group_by in (["rule"], ["rule", "window"]):
        seen, cursor = [], None
        while True:
            page = api.get(
                "/api/v1/flows/rollup",
                {**span, "group_by": group_by, "limit": 1, **({"cursor": cursor} if cursor else {})},
            ).json()
            seen += [r["rule_number"] for r in page["items"]]
            if not (cursor := page["next_cursor"]):
                break
        assert seen == [7, 9, None], group_by


def test_a_window_reaching_into_the_range_from_before_it_counts_whatever_the_window_length(api, db):
    """Reads look back from a range's start by the longest window the workloads reported (kept per
    workload, never shortened), so a window that began before the range and reaches into it counts."""
    from datetime import datetime

    from flows.models import FlowWindow

    web, _, _ = enrolled("web", "10.50.0.1")
    long = windows_between(clock.now() - timedelta(minutes=30), 1)
    started = datetime.fromisoformat(long[0]["start"])
    long[0]["end"] = (started + timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    report = {**flow_report("p1", 100, long), "window_seconds": 300}
    assert flow_report_ingest(workload_id=str(web.id), data=report)["windows"][0]["result"] == "accepted"
    _ingest(web, windows_between(clock.now() - timedelta(minutes=10), 1))  # one-minute windows since
    web.refresh_from_db()
    assert web.flow_window_seconds_longest == 300

    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    for window in FlowWindow.objects.filter(workload=web):
        late_start = window.end - timedelta(seconds=30)  # the range begins inside the window
        span = {
            "workload": str(web.id),
            "from": text(late_start),
            "to": text(late_start + timedelta(minutes=1)),
        }
        listed = api.get("/api/v1/flows", span).json()["items"]
        assert [w["id"] for w in listed] == [str(window.id)], (window.start, window.end)
        rolled = api.get("/api/v1/flows/rollup", {**span, "group_by": "peer"}).json()["items"]
        assert [r["connection_count"] for r in rolled] == [1]


def test_the_review_counts_exactly_beyond_the_lists_it_shows(api, db, monkeypatch):
    from flows import selectors

    monkeypatch.setattr(selectors, "COVERAGE_LIST", 1)
    monkeypatch.setattr(selectors, "WOULD_BLOCK_LIST", 1)
    web, _, _ = enrolled("web", "10.50.0.1")
    enrolled("db", "10.50.0.2")
    enrolled("cache", "10.50.0.3")
    _ingest(web, _windows(web, [
        {"peer": "10.7.7.7", "port": 5432, "decision": "would_block", "connection_count": 9},
        {"peer": "10.7.7.8", "port": 5432, "decision": "would_block", "connection_count": 2},
    ]))  # fmt: skip
    review = api.get("/api/v1/flows/review", _range()).json()
    assert review["workload_count"] == 3
    assert review["would_block_count"] == 2 and len(review["would_block"]) == 1
    assert review["offline_count"] == 3 and len(review["offline"]) == 1
    assert review["not_in_simulation_count"] == 3 and len(review["not_in_simulation"]) == 1
    assert review["coverage"]["workloads_without_reports_count"] == 2
    assert review["reasons"] == [
        "2 would-block groups: enforcing would block them",
        "2 workloads sent no flow window in the range",
        "3 workloads are offline",
        "3 workloads were not in simulation for the whole range",
    ]


def test_a_review_of_no_workload_fails_rather_than_pass_vacuously(api, db):
    enrolled("web", "10.50.0.1")
    review = api.get("/api/v1/flows/review", {**_range(), "label": "app=nothing-has-this"}).json()
    assert review["verdict"] == "fail" and review["workload_count"] == 0
    assert review["reasons"] == ["the selection matches no workload"]


def test_a_workload_holding_evidence_not_delivered_leaves_the_range_incomplete_and_fails_the_review(api, db):
    """Its stream up and synced, its flow reports held back: its heartbeats say since when it holds
    windows. A range reaching past that is incomplete, and the review fails on it; one that ends
    before it, or once the backlog clears, is not."""
    from fleet.models import Workload

    web, _, _ = enrolled("web", "10.50.0.1")
    Workload.objects.filter(id=web.id).update(
        sync_state="synced", mode="simulation", mode_since=clock.now() - timedelta(days=1)
    )
    _ingest(web, _windows(web, [{"port": 443, "decision": "allowed", "connection_count": 1}]))
    span = {**_range(), "workload": str(web.id)}
    assert api.get("/api/v1/flows/review", span).json()["verdict"] == "pass"
    held_since = clock.now() - timedelta(minutes=3)
    Workload.objects.filter(id=web.id).update(flow_backlog_since=held_since)
    review = api.get("/api/v1/flows/review", span).json()
    assert review["verdict"] == "fail"
    assert review["reasons"] == ["1 workload holds flow evidence of the range not delivered yet"]
    covered = review["coverage"]
    assert covered["complete"] is False and covered["pending_workloads_count"] == 1
    (pending,) = covered["pending_workloads"]
    assert pending["workload_id"] == str(web.id) and pending["hostname"] == "web"
    assert datetime.fromisoformat(pending["since"]) == held_since
    rollup = api.get("/api/v1/flows/rollup", {**span, "group_by": "peer"}).json()
    assert rollup["coverage"]["complete"] is False and rollup["coverage"]["pending_workloads_count"] == 1
    before = {**span, "to": (held_since - timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%SZ")}
    assert api.get("/api/v1/flows/review", before).json()["coverage"]["pending_workloads_count"] == 0
    Workload.objects.filter(id=web.id).update(flow_backlog_since=None)
    assert api.get("/api/v1/flows/review", span).json()["verdict"] == "pass"


def test_connections_a_table_decided_outside_simulation_fail_the_review(api, db):
    """The workload's mode says simulation since before the range, but its agent had not applied the
    change (it was away, or its apply failed): its table still observed (visibility) or blocked
    (enforced). What simulation would have said of those connections is unknown."""
    from fleet.models import Workload

    web, _, _ = enrolled("web", "10.50.0.1")
    Workload.objects.filter(id=web.id).update(
        sync_state="synced", mode="simulation", mode_since=clock.now() - timedelta(days=1)
    )
    _ingest(web, _windows(web, [
        {"port": 443, "decision": "allowed", "connection_count": 1},
        {"port": 9090, "decision": "observed", "connection_count": 3},
        {"port": 22, "decision": "blocked", "connection_count": 2},
    ]))  # fmt: skip
    review = api.get("/api/v1/flows/review", {**_range(), "workload": str(web.id)}).json()
    assert review["verdict"] == "fail"
    assert review["reasons"] == [
        "1 workload's table decided connections in the range outside simulation (observed or blocked)"
    ]
    assert review["decided_outside_simulation"] == [
        {"workload_id": str(web.id), "decision": "blocked", "connection_count": 2},
        {"workload_id": str(web.id), "decision": "observed", "connection_count": 3},
    ]


def test_a_workload_gone_silent_is_named_in_the_coverage_until_it_reports_again(api, db, clock_at):
    """Its agent_silent gap is written only when it reports again (rule 2). Until then the coverage
    names it, with its last sign of life, so a total over the silence does not read as complete."""
    from fleet.choices import SyncState
    from fleet.models import Workload

    web, _, _ = enrolled("web", "10.50.0.1")
    quiet, _, _ = enrolled("quiet", "10.50.0.2")
    reconnecting, _, _ = enrolled("reconnecting", "10.50.0.3")
    for workload in (web, quiet, reconnecting):
        _ingest(workload, _windows(workload, [{"connection_count": 1}]))
    last_report = clock.now()
    clock_at(timedelta(minutes=5))  # over two one-minute windows
    # A quiet workload: its stream up, nothing to report. Reconnecting: its stream down, reports arriving.
    Workload.objects.filter(id=quiet.id).update(sync_state=SyncState.SYNCED)
    _ingest(reconnecting, _windows(reconnecting, [{"connection_count": 1}]))

    def coverage(**span):
        return api.get("/api/v1/flows/rollup", {**_range(), **span, "group_by": "workload"}).json()[
            "coverage"
        ]

    covered = coverage()
    assert covered["complete"] is False and covered["silent_workloads_count"] == 1, covered
    (silent,) = covered["silent_workloads"]
    assert silent["workload_id"] == str(web.id) and silent["hostname"] == "web"
    assert abs(datetime.fromisoformat(silent["since"]) - last_report) < timedelta(seconds=1)
    # A range that ends before two windows of silence passed holds no part of it.
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    early = coverage(to=text(last_report + timedelta(seconds=90)))
    assert early["silent_workloads_count"] == 0 and early["complete"] is True, early

    # The agent back, from a new process: the silence becomes a recorded gap and leaves the list.
    restarted = flow_report("p2", 30, _windows(web, [{"connection_count": 1}]))
    flow_report_ingest(workload_id=str(web.id), data=restarted)
    covered = coverage()
    assert covered["silent_workloads_count"] == 0 and covered["silent_workloads"] == []
    assert [g["kind"] for g in covered["gaps"]] == ["agent_silent"], covered


def test_a_range_that_begins_before_the_retention_is_not_complete(api, db):
    """Retention removed what ended before `retained_from`: a total that begins earlier lacks it."""
    from controlplane import runtime

    web, _, _ = enrolled("web", "10.50.0.1")
    _ingest(web, _windows(web, [{"connection_count": 1}]))
    runtime.facts_set(flow_retention_days=2)
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    now = clock.now()
    within = {"from": text(now - timedelta(days=1)), "to": text(now + timedelta(hours=1))}
    covered = api.get("/api/v1/flows/rollup", {**within, "group_by": "peer"}).json()["coverage"]
    assert covered["complete"] is True and covered["begins_before_retention"] is False
    before = {**within, "from": text(now - timedelta(days=3))}
    covered = api.get("/api/v1/flows/rollup", {**before, "group_by": "peer"}).json()["coverage"]
    assert covered["complete"] is False and covered["begins_before_retention"] is True
    assert abs(
        datetime.fromisoformat(covered["retained_from"]) - (now - timedelta(days=2, hours=1))
    ) < timedelta(seconds=5)
    review = api.get("/api/v1/flows/review", {**before, "workload": str(web.id)}).json()
    assert any(
        r.startswith("the range begins before the retention: evidence before ") for r in review["reasons"]
    )


def test_the_flows_command_states_the_retention_serve_prunes_by_not_its_own_environment(db, settings):
    """`manage.py flows` runs beside serve: with serve started on `--flow-retention-days 2` and the
    command's environment saying 30, a range of three days back is still not whole."""
    import json

    from controlplane.models import GatewayIdentity
    from tests.support.helpers import run_command

    settings.PALISADE_FLOW_RETENTION_DAYS = 30
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    now = clock.now()
    three_days = ("--from", text(now - timedelta(days=3)), "--to", text(now))

    def coverage() -> dict:
        code, out, _ = run_command("flows", "rollup", "--group-by", "peer", *three_days, "--json")
        assert code == 0, out
        return json.loads(out)["coverage"]

    assert coverage()["begins_before_retention"] is False  # nothing recorded: the environment's 30 days
    GatewayIdentity.objects.create(
        id=1, address="cp:8443", fingerprint="ab" * 32, flow_retention_days=2, updated_at=now
    )
    covered = coverage()
    assert covered["complete"] is False and covered["begins_before_retention"] is True
    assert abs(
        datetime.fromisoformat(covered["retained_from"]) - (now - timedelta(days=2, hours=1))
    ) < timedelta(seconds=5)


def test_deny_rules_are_hit_unused_grouped_and_named_by_the_review(api, db):
    web, _, _ = enrolled("web", "10.50.0.1")
    ruleset = api.post(
        "/api/v1/rulesets",
        {"name": "web", "scope": "", "rules": [
            {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 443}]},
            {"action": "deny", "sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 23}]},
            {"action": "deny", "sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 25}]},
        ]},
        format="json",
    ).json()  # fmt: skip
    allow, deny, idle = ruleset["rules"]
    _ingest(web, _windows(web, [
        {"port": 443, "decision": "allowed", "rule": allow["number"], "connection_count": 4},
        {"peer": "10.7.7.7", "port": 23, "decision": "blocked", "rule": deny["number"], "connection_count": 3},
        {"peer": "10.7.7.8", "port": 23, "decision": "would_block", "rule": deny["number"], "connection_count": 2},
        {"peer": "10.7.7.9", "port": 22, "decision": "would_block", "connection_count": 1},
    ]))  # fmt: skip
    page = api.get("/api/v1/flows/rollup", {**_range(), "group_by": "rule", "workload": str(web.id)}).json()
    hits = {(r["rule_id"], r["rule_action"], r["connection_count"]) for r in page["items"]}
    assert hits == {(allow["id"], "allow", 4), (deny["id"], "deny", 5), (None, None, 1)}
    # A deny rule that refused nothing in a covered range is unused; the one that refused is not.
    assert [(r["rule_id"], r["action"]) for r in page["unused_rules"]] == [(idle["id"], "deny")]
    by_decision = api.get(
        "/api/v1/flows/rollup", {**_range(), "group_by": ["decision", "rule"], "workload": str(web.id)}
    ).json()
    assert {(r["decision"], r["rule_action"], r["connection_count"]) for r in by_decision["items"]} == {
        ("allowed", "allow", 4), ("blocked", "deny", 3), ("would_block", "deny", 2), ("would_block", None, 1),
    }  # fmt: skip
    review = api.get("/api/v1/flows/review", {**_range(), "workload": str(web.id)}).json()
    assert [(r["peer"], r["rule_number"], r["rule_id"], r["rule_action"]) for r in review["would_block"]] == [
        ("10.7.7.8", deny["number"], deny["id"], "deny"),
        ("10.7.7.9", None, None, None),
    ]

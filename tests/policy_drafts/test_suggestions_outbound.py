"""Suggested outbound rules (`direction: outbound`) from stored outgoing flow windows of known counts, in
process and through the API: the selected workloads' destinations as outbound rules, never what the
destination's inbound policy (both ends), the source's outbound rules or the fail-safe list admit now;
the noise of outgoing connections set apart; the draft saved as it is; and the impact judging outbound
drafts against outbound evidence."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest

from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from fleet.services import workload_labels_replace
from flows.policy_drafts.impact import policy_impact
from flows.policy_drafts.suggestions import policy_suggest
from flows.selectors import workloads_selected
from flows.services import flow_report_ingest
from policy import services
from tests.support.flow_evidence import enrolled, flow_report, windows_between
from tests.support.helpers import assert_problem, run_command

_uptimes = itertools.count(500)
OUTSIDE = "198.51.100.7"
SCANNED = "203.0.113.9"
RESOLVER = "192.0.2.53"
WEB, DB, CACHE = "10.50.0.20", "10.50.0.10", "10.50.0.30"
MINUTES = 10


def _labelled(hostname, address, labels):
    workload, _, _ = enrolled(hostname, address)
    return workload_labels_replace(
        actor=CLI_ACTOR, workload_id=str(workload.id), expected_version=str(workload.labels_version),
        data={"labels": labels},
    )  # fmt: skip


def _ingest(workload, groups_of_minute, minutes=MINUTES):
    windows = windows_between(clock.now() - timedelta(minutes=30), minutes)
    for i, window in enumerate(windows):
        template = window["groups"][0]
        window["groups"] = [{**template, **group} for group in groups_of_minute(i)]
    answer = flow_report_ingest(workload_id=str(workload.id), data=flow_report("p1", next(_uptimes), windows))
    assert all(r["result"] == "accepted" for r in answer["windows"]), answer


def _out(peer, port, count, protocol="tcp", **extra):
    return {"peer": peer, "protocol": protocol, "port": port, "connection_count": count,
            "decision": "observed", "rule": None, "direction": "outbound", **extra}  # fmt: skip


@pytest.fixture
def fleet(db):
    web = _labelled("web1", WEB, {"app": "web"})
    database = _labelled("db1", DB, {"app": "db"})
    cache = _labelled("cache1", CACHE, {"app": "cache"})
    # The database admits the web tier on tcp/5432: web -> db is admitted at the database's end.
    services.ruleset_create(
        actor=CLI_ACTOR,
        data={"name": "db", "scope": "app=db", "rules": [
            {"sources": [{"selector": "app=web"}], "services": [{"protocol": "tcp", "port": 5432}]}]},
    )  # fmt: skip

    def minute(i):
        groups = [
            _out(DB, 5432, 3),  # admitted by db's inbound rule: both ends
            _out(CACHE, 6379, 2),  # nobody admits it: an outbound rule to app=cache
            _out(OUTSIDE, 443, 4),  # outside the fleet: an address group of exactly it
            _out(RESOLVER, 53, 5, protocol="udp", decision="allowed", failsafe=True),  # the fail-safe list
        ]
        if i == 0:
            groups.append(_out(CACHE, 45000, 1))  # a late reply to cache's own connection
            groups += [_out(SCANNED, port, 1) for port in range(1000, 1020)]  # web scanning one host
        return groups

    _ingest(web, minute)
    # What the database received is inbound evidence: an outbound suggestion never learns from it.
    _ingest(database, lambda i: [{"peer": "10.9.9.9", "protocol": "tcp", "port": 5432, "connection_count": 1,
                                  "decision": "observed", "rule": None}])  # fmt: skip
    return web, database, cache


def _range():
    now = clock.now()
    return now - timedelta(hours=1), now + timedelta(minutes=1)


def _suggest(*workloads, **kwargs):
    start, end = _range()
    selected = workloads_selected(workload_ids=[str(w.id) for w in workloads], labels=[])
    return policy_suggest(selected=selected, start=start, end=end, label_keys=["app"], **kwargs)


def _body(**extra):
    start, end = _range()
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    return {"from": text(start), "to": text(end), **extra}


def test_outbound_rules_propose_the_destinations_no_end_admits(fleet):
    web, _, _ = fleet
    answer = _suggest(web, direction="outbound")
    assert answer["direction"] == "outbound" and answer["complete"] is True
    draft = answer["draft"]
    assert answer["rulesets"] == [draft]
    assert (draft["scope"], draft["direction"]) == ("app=web", "outbound")
    [group] = answer["address_groups"]
    assert group["members"] == [OUTSIDE] and group["name"] == "suggested app=web rule 1 destinations"
    assert draft["rules"] == [
        {"description": "Suggested from observed traffic.", "destinations": [{"address_group": group["name"]}],
         "services": [{"protocol": "tcp", "port": 443}]},
        {"description": "Suggested from observed traffic.", "destinations": [{"selector": "app=cache"}],
         "services": [{"protocol": "tcp", "port": 6379}]},
    ]  # fmt: skip
    outside, cache = answer["evidence"][0]["rules"]
    assert (outside["connection_count"], cache["connection_count"]) == (4 * MINUTES, 2 * MINUTES)
    # Admitted now: by the database's inbound rule (both ends) and by the fail-safe list.
    admitted = {(r["peer"], r["service"]["port"]): r["connection_count"] for r in answer["admitted_now"]}
    assert admitted == {(DB, 5432): 3 * MINUTES, (RESOLVER, 53): 5 * MINUTES}
    # Set apart: web's connections to 20 ports of one host, and to an ephemeral port of cache.
    kinds = {s["kind"]: s["count"] for s in answer["set_apart_summary"]}
    assert kinds == {"scanner": 20, "ephemeral-port": 1}, answer["set_apart"]
    assert answer["not_generalised"] == []


def test_the_inbound_answer_is_unchanged_by_outbound_evidence(fleet):
    web, database, _ = fleet
    assert _suggest(web)["rulesets"] == []  # web received nothing
    inbound = _suggest(database)
    assert inbound["direction"] == "inbound"
    [rule] = inbound["draft"]["rules"]
    assert "direction" not in inbound["draft"] and list(rule) == ["description", "sources", "services"]
    assert _suggest(database, direction="outbound")["rulesets"] == []  # the database opened nothing


def test_the_draft_saves_through_the_api_and_then_admits_all_it_learnt_from(api, fleet):
    web, _, _ = fleet
    response = api.post(
        "/api/v1/policies/suggestions",
        _body(workload=[str(web.id)], label_keys=["app"], direction="outbound"),
        format="json",
    )
    assert response.status_code == 200, response.content
    answer = response.json()
    learnt = sum(r["connection_count"] for r in answer["evidence"][0]["rules"])

    # Before saving: the impact of the draft (the policy in force with it) refuses nothing newly and
    # admits exactly the keys learnt from, judged on the outbound evidence (asked: the draft holds both
    # directions, which alone would be judged on inbound evidence, as such bodies always were).
    db_ruleset = {"name": "db", "scope": "app=db", "rules": [
        {"sources": [{"selector": "app=web"}], "services": [{"protocol": "tcp", "port": 5432}]}]}  # fmt: skip
    impact = api.post(
        "/api/v1/policies/impact",
        {"rulesets": [db_ruleset, answer["draft"]], "address_groups": answer["address_groups"],
         **_body(workload=[str(web.id)], direction="outbound")},
        format="json",
    ).json()  # fmt: skip
    assert impact["direction"] == "outbound", impact
    assert impact["newly_refused"] == [] and impact["newly_admitted_summary"]["connection_count"] == learnt
    assert {k["direction"] for k in impact["newly_admitted"]} == {"outbound"}

    saved = api.post("/api/v1/policies/drafts", {"address_groups": answer["address_groups"],
                                                  "rulesets": answer["rulesets"]}, format="json")  # fmt: skip
    assert saved.status_code == 201, saved.content
    ruleset = api.get(f"/api/v1/rulesets/{saved.json()['rulesets'][0]['id']}").json()
    assert ruleset["direction"] == "outbound" and [r["services"] for r in ruleset["rules"]] == [
        r["services"] for r in answer["draft"]["rules"]
    ]
    again = _suggest(web, direction="outbound")
    assert again["rulesets"] == [] and again["not_generalised"] == []
    admitted_rules = {r["service"]["port"] for r in again["admitted_now"]}
    assert admitted_rules == {443, 6379, 5432, 53}


def test_the_impact_of_dropping_the_database_rule_refuses_web_outbound_both_ends(fleet):
    web, _, _ = fleet
    start, end = _range()
    window = {"from": start.isoformat(), "to": end.isoformat(), "workload": [str(web.id)]}
    # The draft keeps no inbound rule for the database: web's outgoing connection to it loses the
    # admission of the database's end, though the draft names no outbound ruleset at all.
    answer = policy_impact(data={"rulesets": [], **window, "direction": "outbound"})
    [refused] = answer["newly_refused"]
    assert (refused["peer"], refused["port"], refused["direction"], refused["mode"]) == (
        DB, 5432, "outbound", "visibility")  # fmt: skip
    assert refused["rule_now"]["ruleset_name"] == "db" and refused["rule_draft"] is None
    # Inbound by default for a draft without outbound rulesets: web received nothing.
    inbound = policy_impact(data={"rulesets": [], **window})
    assert inbound["direction"] == "inbound" and inbound["keys_classified"] == 0
    # A draft of outbound rulesets only is judged on outbound evidence without asking: web's own
    # outbound rule to the database keeps 5432, and the cache's 6379 is admitted newly.
    own = {"name": "web out", "direction": "outbound", "scope": "app=web", "rules": [
        {"destinations": [{"selector": "app=db"}, {"selector": "app=cache"}],
         "services": [{"protocol": "tcp", "port": 5432}, {"protocol": "tcp", "port": 6379}]}]}  # fmt: skip
    judged = policy_impact(data={"rulesets": [own], **window})
    assert judged["direction"] == "outbound" and judged["newly_refused"] == []
    assert {(k["peer"], k["port"]) for k in judged["newly_admitted"]} == {(CACHE, 6379)}
    # Both directions held, nothing asked: inbound, as the console's whole-set bodies always were.
    both = policy_impact(data={"rulesets": [own, {"name": "x", "scope": "app=x"}], **window})
    assert both["direction"] == "inbound" and both["keys_classified"] == 0


def test_bad_directions_are_findings(api, fleet):
    for direction in ("any", "sideways", 3):
        body = assert_problem(
            api.post("/api/v1/policies/suggestions", _body(direction=direction), format="json"),
            422,
            "validation",
        )
        assert [e["path"] for e in body["errors"]] == ["/direction"], body
    body = assert_problem(
        api.post("/api/v1/policies/impact", {"rulesets": [], **_body(direction="up")}, format="json"),
        422, "validation",
    )  # fmt: skip
    assert "/direction" in [e["path"] for e in body["errors"]], body


def test_manage_py_policy_suggest_takes_the_direction(fleet):
    web, _, _ = fleet
    start, end = _range()
    code, out, _ = run_command(
        "policy", "suggest", "--from", start.isoformat(), "--to", end.isoformat(),
        "--workload", str(web.id), "--label-key", "app", "--direction", "outbound", "--json",
    )  # fmt: skip
    assert code == 0 and '"direction": "outbound"' in out and '"destinations"' in out


def test_the_dryrun_renders_an_outbound_draft_into_the_output_chains_that_judge(api, fleet):
    web, _, _ = fleet
    own = {"name": "web out", "direction": "outbound", "scope": "app=web", "rules": [
        {"destinations": [{"selector": "app=cache"}], "services": [{"protocol": "tcp", "port": 6379}]}]}  # fmt: skip
    stored = api.get("/api/v1/rulesets").json()["rulesets"]

    def dryrun(rulesets):
        answer = api.post("/api/v1/policies/render-dryrun", {"rulesets": rulesets}, format="json")
        assert answer.status_code == 200, answer.content
        return {c["workload_id"]: c for c in answer.json()["changed"]}

    # Outbound in visibility: no output chain, so an outbound draft changes no document.
    assert str(web.id) not in dryrun([*stored, own])
    change = api.post("/api/v1/mode-changes", {"selection": {"workload_ids": [str(web.id)]},
                                               "mode": "simulation", "direction": "outbound"}, format="json")  # fmt: skip
    assert change.status_code == 202, change.content
    changed = dryrun([*stored, own])
    assert list(changed) == [str(web.id)]
    assert [r["ruleset_name"] for r in changed[str(web.id)]["rules_added"]] == ["web out"]
    # The database's inbound rule dropped: web's output chain loses it too (one rule, both ends).
    without_db = dryrun([own])
    assert {r["ruleset_name"] for r in without_db[str(web.id)]["rules_removed"]} == {"db"}

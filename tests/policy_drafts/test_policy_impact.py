"""POST /policies/impact: stored flow keys judged by the policy now and by a draft; the keys that change."""

from __future__ import annotations

import itertools
import json
from datetime import timedelta

from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from controlplane.http_threads import HEAVY_PATHS
from fleet.services import workload_labels_replace
from flows.policy_drafts.impact import policy_impact
from flows.services import flow_report_ingest
from tests.support.flow_evidence import enrolled, flow_report, windows_between
from tests.support.helpers import assert_problem
from tests.support.helpers import run_command as run

_uptimes = itertools.count(100)


def _text(t):
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _range():
    now = clock.now()
    return {"from": _text(now - timedelta(hours=1)), "to": _text(now + timedelta(hours=1))}


def _labelled(hostname, address, labels):
    workload, _, _ = enrolled(hostname, address)
    workload_labels_replace(
        actor=CLI_ACTOR, workload_id=str(workload.id), expected_version="1", data={"labels": labels}
    )
    return workload


def _ingest(workload, groups, gaps=()):
    windows = windows_between(clock.now() - timedelta(minutes=10), 1) if groups else []
    if groups:
        windows[0]["groups"] = [{**windows[0]["groups"][0], **group} for group in groups]
    report = {**flow_report("p1", next(_uptimes), windows), "gaps": list(gaps)}
    answer = flow_report_ingest(workload_id=str(workload.id), data=report)
    assert all(r["result"] == "accepted" for r in answer["windows"] + answer["gaps"]), answer


def _policy(api):
    assert (
        api.post(
            "/api/v1/address-groups", {"name": "office", "members": ["10.9.0.0/16"]}, format="json"
        ).status_code
        == 201
    )
    created = api.post(
        "/api/v1/rulesets",
        {
            "name": "db",
            "scope": "app=db",
            "rules": [
                {"sources": [{"selector": "app=web"}], "services": [{"protocol": "tcp", "port": 5432}]},
                {"sources": [{"address_group": "office"}], "services": [{"protocol": "tcp", "port": 22}]},
            ],
        },
        format="json",
    )  # fmt: skip
    assert created.status_code == 201, created.content
    return created.json()


def _scenario(api):
    web = _labelled("web", "10.50.0.1", {"app": "web"})
    db = _labelled("db", "10.50.0.2", {"app": "db"})
    ruleset = _policy(api)
    _ingest(db, [
        {"peer": "10.50.0.1", "protocol": "tcp", "port": 5432, "connection_count": 7},
        {"peer": "10.9.9.9", "protocol": "tcp", "port": 22, "connection_count": 3},
        {"peer": "10.8.8.8", "protocol": "tcp", "port": 6379, "connection_count": 2},
        {"peer": "10.8.8.8", "protocol": "icmp", "port": 0, "connection_count": 1},
    ])  # fmt: skip
    ssh_rule = ruleset["rules"][1]
    draft = {
        "rulesets": [
            {
                "name": "db",
                "scope": "app=db",
                "rules": [
                    {"id": ssh_rule["id"], "sources": [{"address_group": "office"}],
                     "services": [{"protocol": "tcp", "port": 22}]},
                    {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 6379}]},
                ],
            }
        ]
    }  # fmt: skip
    return web, db, ruleset, draft


def test_impact_lists_the_keys_whose_outcome_the_draft_changes(api, db):
    web, db_host, ruleset, draft = _scenario(api)
    version_before = api.get("/api/v1/rulesets").json()["policy_version"]

    answer = api.post(
        "/api/v1/policies/impact", {**draft, **_range(), "workload": [str(db_host.id)]}, format="json"
    )
    assert answer.status_code == 200, answer.content
    impact = answer.json()
    [refused] = impact["newly_refused"]
    assert (refused["workload_id"], refused["peer"], refused["protocol"], refused["port"]) == (
        str(db_host.id), "10.50.0.1", "tcp", 5432,
    )  # fmt: skip
    assert refused["peer_workload_id"] == str(web.id) and refused["connection_count"] == 7
    assert refused["mode"] == "visibility" and refused["first_seen"] and refused["last_seen"]
    assert refused["rule_now"]["rule_id"] == ruleset["rules"][0]["id"]
    assert refused["rule_now"]["ruleset_name"] == "db" and refused["rule_draft"] is None
    [admitted] = impact["newly_admitted"]
    assert (admitted["peer"], admitted["port"], admitted["connection_count"]) == ("10.8.8.8", 6379, 2)
    assert admitted["rule_now"] is None and admitted["rule_draft"]["position"] == 1
    assert impact["newly_refused_summary"] == {
        "count": 1, "connection_count": 7, "peer_count": 1, "service_count": 1, "workload_count": 1,
    }  # fmt: skip
    assert impact["keys_classified"] == 4 and impact["truncated"] is False
    assert impact["coverage"]["complete"] is True  # db alone reported
    # Nothing was saved.
    assert api.get("/api/v1/rulesets").json()["policy_version"] == version_before

    # The whole fleet: web sent nothing, so no answer reads as complete.
    fleet = api.post("/api/v1/policies/impact", {**draft, **_range()}, format="json").json()
    assert fleet["coverage"]["complete"] is False
    assert fleet["coverage"]["workloads_without_reports"] == [str(web.id)]
    assert [k["port"] for k in fleet["newly_refused"]] == [5432]

    # A label selection that leaves db out sees nothing change; the policy in force as its own draft neither.
    none = policy_impact(data={**draft, **_range(), "label": ["app=web"]})
    assert none["newly_refused"] == [] and none["newly_admitted"] == [] and none["keys_classified"] == 0
    same = {"rulesets": [{k: ruleset[k] for k in ("name", "scope")} | {"rules": [
        {k: r[k] for k in ("id", "sources", "services")} for r in ruleset["rules"]]}]}  # fmt: skip
    unchanged = policy_impact(data={**same, **_range()})
    assert unchanged["newly_refused"] == [] and unchanged["newly_admitted"] == []


def test_bad_bodies_are_validation_problems_naming_every_field(api, db):
    answer = api.post(
        "/api/v1/policies/impact",
        {
            "rulesets": [{"name": "x"}],
            "from": "yesterday",
            "label": ["a in ()"],
            "workload": "nope",
            "extra": 1,
        },
        format="json",
    )
    body = assert_problem(answer, 422, "validation")
    paths = {error["path"] for error in body["errors"]}
    assert {"/from", "/to", "/label/0", "/workload", "/extra"} <= paths, body
    assert any(path.startswith("/rulesets/0") for path in paths), body

    reversed_range = {"rulesets": [], "from": "2026-01-02T00:00:00Z", "to": "2026-01-01T00:00:00Z"}
    body = assert_problem(
        api.post("/api/v1/policies/impact", reversed_range, format="json"), 422, "validation"
    )
    assert [error["path"] for error in body["errors"]] == ["/to"]
    assert_problem(api.post("/api/v1/policies/impact", [], format="json"), 422, "validation")


def test_manage_py_policy_impact_calls_the_same_function(api, db, monkeypatch, tmp_path):
    web, db_host, _, draft = _scenario(api)
    span = _range()
    spec = tmp_path / "draft.json"
    spec.write_text(json.dumps(draft))
    code, out, _ = run("policy", "impact", str(spec), "--from", span["from"], "--to", span["to"], "--json")
    assert code == 0
    answer = json.loads(out)
    direct = policy_impact(data={**draft, **span})
    # retained_from is computed from now: the rest is the same answer.
    assert {**answer, "coverage": None} == {**direct, "coverage": None}
    assert answer["coverage"]["workloads_without_reports"] == [str(web.id)]
    assert [k["port"] for k in answer["newly_refused"]] == [5432]

    code, out, _ = run(
        "policy",
        "impact",
        str(spec),
        "--from",
        span["from"],
        "--to",
        span["to"],
        "--workload",
        str(db_host.id),
    )
    assert code == 0
    assert "newly refuse 7 connections from 1 peer to 1 service" in out
    assert f"newly refused: {db_host.id} <- 10.50.0.1 tcp/5432: 7 connections" in out
    assert "INCOMPLETE" not in out
    code, out, _ = run("policy", "impact", str(spec), "--from", span["from"], "--to", span["to"])
    assert code == 0 and out.startswith("INCOMPLETE RANGE")  # web sent nothing

    code, _, err = run("policy", "impact", str(spec), "--from", "nope", "--to", span["to"])
    assert code == 2 and err.strip().splitlines() == ["error: /from: from is an RFC 3339 instant. [instant]"]
    spec.write_text("[]")
    code, _, err = run("policy", "impact", str(spec), "--from", span["from"], "--to", span["to"])
    assert code == 2 and err.startswith("error: ")


def test_impact_runs_on_the_heavy_pool():
    # Its work grows with the range, the fleet and the draft, as the dry-run's does.
    assert "/api/v1/policies/impact" in HEAVY_PATHS


def test_an_evidence_gap_makes_the_impact_incomplete_and_is_named(api, db):
    _, db_host, _, draft = _scenario(api)
    gap = {"id": "8c1d2e3f-4a5b-4c6d-8e7f-9a0b1c2d3e4f", "kind": "source_restart", "source": "conntrack",
           "start": windows_between(clock.now() - timedelta(minutes=5), 1)[0]["start"],
           "end": windows_between(clock.now() - timedelta(minutes=4), 1)[0]["start"], "lost": {}}  # fmt: skip
    _ingest(db_host, [], [gap])
    impact = policy_impact(data={**draft, **_range(), "workload": [str(db_host.id)]})
    assert impact["coverage"]["complete"] is False and impact["coverage"]["gap_count"] == 1
    assert [(g["id"], g["kind"]) for g in impact["coverage"]["gaps"]] == [(gap["id"], "source_restart")]
    assert impact["newly_refused_summary"]["connection_count"] == 7  # the evidence there is still counts


def test_a_draft_adding_a_deny_rule_newly_refuses_exactly_what_it_matches_by_that_rule(api, db):
    web, db_host, ruleset, _ = _scenario(api)
    kept = [{k: r[k] for k in ("id", "sources", "services")} for r in ruleset["rules"]]
    blocklist = {
        "name": "blocklist",
        "scope": "app=db",
        "rules": [
            # refuses the office's ssh (admitted now) and 6379 (refused now already: not newly refused)
            {"action": "deny", "sources": [{"any": True}],
             "services": [{"protocol": "tcp", "port": 22}, {"protocol": "tcp", "port": 6379}]},
            {"action": "deny", "sources": [{"selector": "app=web"}], "services": [{"protocol": "udp", "port": 53}]},
        ],
    }  # fmt: skip
    draft = {"rulesets": [{"name": "db", "scope": "app=db", "rules": kept}, blocklist]}
    impact = policy_impact(data={**draft, **_range()})
    [refused] = impact["newly_refused"]
    assert (refused["peer"], refused["protocol"], refused["port"], refused["connection_count"]) == (
        "10.9.9.9", "tcp", 22, 3,
    )  # fmt: skip
    assert refused["rule_now"]["rule_id"] == ruleset["rules"][1]["id"]
    assert refused["rule_draft"]["rule_id"] == "new:blocklist:0"
    assert refused["rule_draft"]["action"] == "deny" and refused["rule_draft"]["ruleset_name"] == "blocklist"
    assert impact["newly_admitted"] == []

    # Saved, the deny rule is in force: a draft without it admits the key again, and names the deny
    # rule as what refuses it now.
    saved = api.post("/api/v1/rulesets", blocklist, format="json").json()
    deny_number = saved["rules"][0]["number"]
    lifted = policy_impact(data={"rulesets": [{"name": "db", "scope": "app=db", "rules": kept}], **_range()})
    [admitted] = lifted["newly_admitted"]
    assert (admitted["peer"], admitted["port"]) == ("10.9.9.9", 22)
    assert admitted["rule_now"]["number"] == deny_number and admitted["rule_now"]["action"] == "deny"
    assert admitted["rule_draft"]["rule_id"] == ruleset["rules"][1]["id"]
    assert lifted["newly_refused"] == []


def test_a_deny_rule_refusing_everything_is_a_dryrun_warning(api, db):
    _labelled("db", "10.50.0.2", {"app": "db"})
    everything = [
        {"protocol": "tcp", "port": 1, "port_to": 65535},
        {"protocol": "udp", "port": 1, "port_to": 40000},
        {"protocol": "udp", "port": 39000, "port_to": 65535},
        {"protocol": "icmp"},
        {"protocol": "icmpv6"},
    ]
    rulesets = [
        {"name": "a", "scope": "app=db", "rules": [
            {"sources": [{"any": True}], "services": everything},  # an allow: no warning
            {"action": "deny", "sources": [{"any": True}], "services": everything[:4]},  # icmpv6 left
            {"action": "deny", "sources": [{"selector": "app=x"}, {"any": True}], "services": everything},
        ]},
    ]  # fmt: skip
    answer = api.post("/api/v1/policies/render-dryrun", {"rulesets": rulesets}, format="json")
    assert answer.status_code == 200, answer.content
    flagged = [w for w in answer.json()["warnings"] if w["rule"] == "deny-refuses-everything"]
    assert [w["path"] for w in flagged] == ["/rulesets/0/rules/2"]
    assert "'app=db'" in flagged[0]["message"]


def test_the_dryrun_lists_a_rule_turned_deny_as_changed(api, db):
    web, db_host, ruleset, _ = _scenario(api)
    api.post("/api/v1/mode-changes", {"selection": {"workload_ids": [str(db_host.id)]}, "mode": "enforced"},
             format="json")  # fmt: skip
    rules = [{k: r[k] for k in ("id", "sources", "services")} for r in ruleset["rules"]]
    rules[1]["action"] = "deny"
    answer = api.post(
        "/api/v1/policies/render-dryrun", {"rulesets": [{"name": "db", "scope": "app=db", "rules": rules}]},
        format="json",
    ).json()  # fmt: skip
    [changed] = answer["changed"]
    assert changed["workload_id"] == str(db_host.id)
    assert changed["rules_changed"] == [{"ruleset_name": "db", "rule_id": ruleset["rules"][1]["id"]}]

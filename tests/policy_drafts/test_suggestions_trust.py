"""Suggestions an operator can save and trust (issue 32): drafts within every limit of a ruleset write,
ranges of ports, saves all or nothing, learning from what the policy in force would refuse, scopes
inside the selection, breadth, noise set apart, names and numbers per rule."""

from __future__ import annotations

import copy
import itertools
import json
from datetime import timedelta

import pytest

from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from fleet.services import workload_labels_replace
from flows.policy_drafts.suggestions import policy_suggest
from flows.selectors import workloads_selected
from flows.services import flow_report_ingest
from policy import services
from policy.grammar import parse_selector
from policy.models import AddressGroup, Ruleset
from tests.support.flow_evidence import enrolled, flow_report, windows_between
from tests.support.helpers import run_command

_uptimes = itertools.count(50_000)
SCANNER = "203.0.113.66"


def _labelled(hostname, address, labels):
    workload, _, _ = enrolled(hostname, address)
    return workload_labels_replace(
        actor=CLI_ACTOR, workload_id=str(workload.id), expected_version=str(workload.labels_version),
        data={"labels": labels},
    )  # fmt: skip


def _ingest(workload, groups):
    [window] = windows_between(clock.now() - timedelta(minutes=20), 1)
    template = window["groups"][0]
    window["groups"] = [{**template, **g} for g in groups]
    answer = flow_report_ingest(workload_id=str(workload.id), data=flow_report("p", next(_uptimes), [window]))
    assert all(r["result"] == "accepted" for r in answer["windows"]), answer


def _range():
    return clock.now() - timedelta(hours=1), clock.now() + timedelta(minutes=1)


def _suggest(selected=None, labels=(), **kwargs):
    start, end = _range()
    return policy_suggest(selected=selected, start=start, end=end, selection_labels=list(labels), **kwargs)


def _selection(labels=(), ids=()):
    parsed = [parse_selector(t) for t in labels]
    return workloads_selected(workload_ids=[str(i) for i in ids], labels=parsed), parsed


def _body(answer):
    return {"address_groups": answer["address_groups"], "rulesets": answer["rulesets"]}


@pytest.fixture
def server(db):
    return _labelled("job1", "10.70.0.10", {"app": "job", "env": "prod"})


def test_a_run_of_ports_is_one_range_and_past_64_services_the_rule_is_split(server):
    client = "198.51.100.20"
    scattered = [20000 + 7 * i for i in range(170)]  # 170 services, none adjacent
    _ingest(
        server,
        [{"peer": client, "port": p, "connection_count": 5} for p in range(7000, 7100)]
        + [{"peer": "198.51.100.21", "port": p, "connection_count": 5} for p in scattered],
    )
    answer = _suggest()
    rules = answer["draft"]["rules"]
    ranged = [r for r in rules if {"protocol": "tcp", "port": 7000, "port_to": 7099} in r["services"]]
    assert len(ranged) == 1 and len(ranged[0]["services"]) == 1
    others = [r for r in rules if r is not ranged[0]]
    assert [len(r["services"]) for r in others] == [64, 64, 42]
    assert sorted(s["port"] for r in others for s in r["services"]) == scattered
    evidence = answer["evidence"][0]["rules"][rules.index(ranged[0])]
    assert evidence["port_ranges"] == [
        {"protocol": "tcp", "port": 7000, "port_to": 7099, "ports_seen": 100, "ports_unseen": 0}
    ]
    # the draft saves as it is: every rule within the limits
    code, out, err = run_command("policy", "save", "-", "--json", stdin_text=json.dumps(_body(answer)),
                                 monkeypatch=pytest.MonkeyPatch())  # fmt: skip
    assert code == 0, err
    assert len(json.loads(out)["rulesets"]) == 1


def test_a_dense_run_with_gaps_is_a_range_that_says_the_ports_it_admits_unseen(server):
    ports = [p for p in range(8000, 8020) if p not in (8005, 8011)]
    _ingest(server, [{"peer": "198.51.100.20", "port": p, "connection_count": 5} for p in ports])
    answer = _suggest()
    [rule] = answer["draft"]["rules"]
    assert rule["services"] == [{"protocol": "tcp", "port": 8000, "port_to": 8019}]
    [ranged] = answer["evidence"][0]["rules"][0]["port_ranges"]
    assert (ranged["ports_seen"], ranged["ports_unseen"]) == (18, 2)


def test_a_refused_save_leaves_nothing_behind_and_points_at_the_rule(api, server):
    _ingest(server, [{"peer": "198.51.100.20", "port": 22, "connection_count": 5}])
    answer = _suggest()
    body = copy.deepcopy(_body(answer))
    body["rulesets"].append({**copy.deepcopy(body["rulesets"][0]), "name": "second"})
    body["rulesets"][1]["rules"][0]["services"] = [{"protocol": "tcp", "port": 70000}]
    response = api.post("/api/v1/policies/drafts", body, format="json")
    assert response.status_code == 422
    assert [e["path"] for e in response.json()["errors"]] == ["/rulesets/1/rules/0/services/0/port"]
    assert AddressGroup.objects.count() == 0 and Ruleset.objects.count() == 0
    # refused by the database (a name taken) after the groups were written: rolled back too
    services.ruleset_create(actor=CLI_ACTOR, data={"name": "second", "scope": "app=x"})
    body["rulesets"][1]["rules"][0]["services"] = [{"protocol": "tcp", "port": 23}]
    response = api.post("/api/v1/policies/drafts", body, format="json")
    assert response.status_code == 422
    assert response.json()["errors"][0]["path"] == "/rulesets/1/name"
    assert AddressGroup.objects.count() == 0 and Ruleset.objects.count() == 1
    response = api.post("/api/v1/policies/drafts", _body(answer), format="json")
    assert response.status_code == 201, response.json()
    assert [g["name"] for g in response.json()["address_groups"]] == [answer["address_groups"][0]["name"]]


def test_suggest_answer_piped_into_policy_save_saves_it_unchanged(server, monkeypatch):
    _ingest(server, [{"peer": "198.51.100.20", "port": 22, "connection_count": 5}])
    start, end = _range()
    stamp = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    code, out, err = run_command("policy", "suggest", "--from", stamp(start), "--to", stamp(end), "--answer")
    assert code == 0, err
    code, saved, err = run_command("policy", "save", "-", stdin_text=out, monkeypatch=monkeypatch)
    assert code == 0, err
    assert "created address group 'suggested app=job rule 1 peers'" in saved
    assert "created ruleset 'suggested app=job'" in saved


def test_a_key_allowed_by_a_rule_deleted_since_is_learnt_and_one_in_force_is_not(server):
    kept = services.ruleset_create(
        actor=CLI_ACTOR,
        data={"name": "ssh", "scope": "app=job", "rules": [
            {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 22}]}]},
    )  # fmt: skip
    number = kept.rules.get().number
    _ingest(server, [
        {"peer": "198.51.100.20", "port": 22, "decision": "allowed", "rule": number, "connection_count": 4},
        {"peer": "198.51.100.20", "port": 9100, "decision": "allowed", "rule": number + 40, "connection_count": 4},
    ])  # fmt: skip
    answer = _suggest()
    assert [r["services"] for r in answer["draft"]["rules"]] == [[{"protocol": "tcp", "port": 9100}]]
    assert [k["service"]["port"] for k in answer["admitted_now"]] == [22]


def test_the_scope_keeps_the_selections_labels_and_sources_learn_env_too(db):
    prod = _labelled("db-prod", "10.70.0.1", {"app": "db", "env": "prod"})
    _labelled("db-stage", "10.70.0.2", {"app": "db", "env": "stage"})
    _labelled("api-prod", "10.70.0.3", {"app": "api", "env": "prod"})
    _labelled("api-stage", "10.70.0.4", {"app": "api", "env": "stage"})
    _ingest(prod, [{"peer": "10.70.0.3", "port": 5432, "connection_count": 9}])
    selected, labels = _selection(["app=db,env=prod"])
    answer = _suggest(selected, labels)
    assert answer["label_keys"] == ["app", "env"]
    assert answer["draft"]["scope"] == "app=db,env=prod"
    assert answer["draft"]["rules"][0]["sources"] == [{"selector": "app=api,env=prod"}]
    # one workload id: the scope is narrowed by a label it has, and says why
    selected, _ = _selection(ids=[prod.id])
    answer = _suggest(selected, label_keys=["app"])
    assert answer["draft"]["scope"] == "app=db,env=prod"
    [note] = answer["scope_notes"]
    assert note["scope"] == "app=db" and "db-stage" in note["reason"]


def test_a_scope_that_cannot_stay_inside_the_selection_is_refused_with_why(db):
    one = _labelled("db-a", "10.70.0.1", {"app": "db"})
    _labelled("db-b", "10.70.0.2", {"app": "db"})
    _ingest(one, [{"peer": "198.51.100.20", "port": 5432, "connection_count": 9}])
    selected, _ = _selection(ids=[one.id])
    answer = _suggest(selected, label_keys=["app"])
    assert answer["rulesets"] == []
    [row] = answer["not_generalised"]
    assert "db-b" in row["reason"] and "not widened" in row["reason"]


def test_each_rule_states_its_breadth_and_a_wide_one_is_warned_of(db):
    server = _labelled("db1", "10.70.0.1", {"app": "db"})
    for i in range(2, 5):
        _labelled(f"db{i}", f"10.70.0.{i}", {"app": "db"})
    _ingest(server, [{"peer": "198.51.100.20", "port": 5432, "connection_count": 9}])
    answer = _suggest()
    breadth = answer["evidence"][0]["rules"][0]["breadth"]
    # four workloads match app=db, one peer, one port: 4 admitted against the 1 seen
    assert breadth == {"admitted": 4, "seen": 1, "ratio": 4.0, "wider_than_seen": True}
    assert answer["breadth_warnings"] == [
        "suggested app=db, rule 1: admits 4 (workload, peer, service) combinations against 1 seen (4.0x)"
    ]


def test_noise_is_set_apart_with_its_reason_and_included_on_request(db):
    server = _labelled("web1", "10.70.0.1", {"app": "web"})
    for i in range(2, 6):
        _labelled(f"web{i}", f"10.70.0.{i}", {"app": "web"})
    typo = _labelled("webx", "10.70.0.9", {"app": "Web"})
    _ingest(server, [
        *({"peer": SCANNER, "port": 1000 + p, "connection_count": 1} for p in range(20)),
        {"peer": "198.51.100.53", "protocol": "udp", "port": 45123, "connection_count": 1},
        {"peer": "10.70.0.9", "port": 443, "connection_count": 7},
        {"peer": "192.0.2.5", "port": 443, "connection_count": 7},
        {"peer": "198.51.100.20", "port": 443, "connection_count": 7},
    ])  # fmt: skip
    answer = _suggest(exclude_peers=["192.0.2.0/24"])
    kinds = {row["kind"] for row in answer["set_apart"]}
    assert kinds == {"scanner", "ephemeral-port", "lookalike-label", "excluded-peer"}
    [lookalike] = [r for r in answer["set_apart"] if r["kind"] == "lookalike-label"]
    assert lookalike["reason"].startswith("app=Web looks like app=web (differs only in case")
    assert lookalike["peer_workload_id"] == str(typo.id)
    [rule] = answer["draft"]["rules"]
    members = answer["address_groups"][0]["members"]
    assert rule["services"] == [{"protocol": "tcp", "port": 443}] and members == ["198.51.100.20"]
    summary = {s["kind"]: s["count"] for s in answer["set_apart_summary"]}
    assert summary == {"scanner": 20, "ephemeral-port": 1, "lookalike-label": 1, "excluded-peer": 1}
    included = _suggest(include_noise=["scanner"])
    ports = {s.get("port") for r in included["draft"]["rules"] for s in r["services"]}
    assert 1000 in ports


def test_each_group_is_named_for_its_rule_with_its_own_unseen_count(db):
    server = _labelled("db1", "10.70.0.1", {"app": "db"})
    _ingest(server, [
        {"peer": "198.51.100.1", "port": 22, "connection_count": 3},
        {"peer": "198.51.100.2", "port": 22, "connection_count": 3},
        {"peer": "203.0.113.9", "port": 5432, "connection_count": 3},
    ])  # fmt: skip
    answer = _suggest(aggregate_prefix=24)
    names = [g["name"] for g in answer["address_groups"]]
    assert names == ["suggested app=db rule 1 peers", "suggested app=db rule 2 peers"]
    unseen = {g["name"]: g["unseen_addresses_admitted"] for g in answer["address_group_evidence"]}
    assert unseen == {names[0]: 254, names[1]: 255}


def test_the_review_gives_a_second_verdict_against_the_policy_in_force_now(api, server):
    _ingest(server, [
        {"peer": "198.51.100.20", "port": 22, "decision": "would_block", "connection_count": 4},
        {"peer": "198.51.100.20", "port": 9100, "decision": "would_block", "connection_count": 4},
    ])  # fmt: skip
    services.ruleset_create(
        actor=CLI_ACTOR,
        data={"name": "ssh", "scope": "app=job", "rules": [
            {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 22}]}]},
    )  # fmt: skip
    start, end = _range()
    stamp = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    review = api.get(
        "/api/v1/flows/review", {"from": stamp(start), "to": stamp(end), "workload": str(server.id)}
    ).json()
    assert (
        review["would_block_count"] == 2 and review["judged_against"] == "the decisions recorded in the range"
    )
    now = review["now"]
    assert now["judged_against"] == "the policy in force now"
    assert (now["would_block_count"], now["admitted_since_count"]) == (1, 1)
    assert now["reasons"][0].startswith("1 would-block group that the policy in force now would still refuse")
    assert not any(r.startswith("2 would-block") for r in now["reasons"])

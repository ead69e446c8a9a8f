"""Suggested rules from stored flow windows of known counts, in process."""

from __future__ import annotations

import dataclasses
import itertools
import json
import uuid
from datetime import timedelta

import pytest

from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from controlplane.problems import ValidationFailed
from fleet.services import workload_labels_replace
from flows.policy_drafts.suggestions import policy_suggest
from flows.selectors import workloads_selected
from flows.services import flow_report_ingest
from policy import services
from policy.grammar import parse_selector
from policy.representations import ruleset_data
from tests.support.flow_evidence import enrolled, flow_report, windows_between
from tests.support.helpers import assert_problem, run_command

_uptimes = itertools.count(100)
OUTSIDE = "198.51.100.7"


def _labelled(hostname, address, labels):
    workload, _, _ = enrolled(hostname, address)
    return workload_labels_replace(
        actor=CLI_ACTOR, workload_id=str(workload.id), expected_version=str(workload.labels_version),
        data={"labels": labels},
    )  # fmt: skip


def _ingest(workload, windows, gaps=()):
    report = flow_report("p1", next(_uptimes), windows)
    report["gaps"] = list(gaps)
    answer = flow_report_ingest(workload_id=str(workload.id), data=report)
    assert all(r["result"] == "accepted" for r in answer["windows"] + answer["gaps"]), answer


def _traffic(minutes, groups_of_minute):
    """Back-to-back windows from 30 minutes ago, each with the groups `groups_of_minute(i)` gives."""
    windows = windows_between(clock.now() - timedelta(minutes=30), minutes)
    for i, window in enumerate(windows):
        template = window["groups"][0]
        window["groups"] = [{**template, **group} for group in groups_of_minute(i)]
    return windows


@pytest.fixture
def fleet(db):
    server = _labelled("db1", "10.50.0.10", {"app": "db"})
    clients = [_labelled(f"web{i}", f"10.50.0.{20 + i}", {"app": "web", "tier": f"t{i}"}) for i in range(3)]
    return server, clients


def _scenario(server, clients, minutes=20):
    """Every client connects to tcp/5432 of the server (client i: i+1 connections a minute), the
    outside address to tcp/22 (2 a minute), all decided `observed`."""

    def groups(_minute):
        return [
            *(
                {"peer": f"10.50.0.{20 + i}", "port": 5432, "connection_count": i + 1}
                for i in range(len(clients))
            ),
            {"peer": OUTSIDE, "port": 22, "connection_count": 2},
        ]

    _ingest(server, _traffic(minutes, groups))
    return {"db": sum(i + 1 for i in range(len(clients))) * minutes, "ssh": 2 * minutes}


def _range():
    now = clock.now()
    return now - timedelta(hours=1), now + timedelta(minutes=1)


def _suggest(server, **kwargs):
    start, end = kwargs.pop("range", _range())
    selected = workloads_selected(workload_ids=[str(server.id)], labels=[])
    return policy_suggest(selected=selected, start=start, end=end, **kwargs)


def test_the_issues_scenario_gives_two_rules_of_the_listening_ports_with_the_counts_seen(fleet):
    server, clients = fleet
    counts = _scenario(server, clients)
    answer = _suggest(server, label_keys=["app"])
    assert answer["complete"] is True and answer["warning"] is None
    assert answer["rulesets"] == [answer["draft"]]
    draft = answer["draft"]
    assert draft["scope"] == "app=db"
    [group] = answer["address_groups"]
    assert group["members"] == [OUTSIDE]
    assert draft["rules"] == [
        {"description": "Suggested from observed traffic.", "sources": [{"address_group": group["name"]}],
         "services": [{"protocol": "tcp", "port": 22}]},
        {"description": "Suggested from observed traffic.", "sources": [{"selector": "app=web"}],
         "services": [{"protocol": "tcp", "port": 5432}]},
    ]  # fmt: skip
    ssh, database = answer["evidence"][0]["rules"]
    assert (ssh["connection_count"], database["connection_count"]) == (counts["ssh"], counts["db"])
    assert [p["peer"] for p in database["peers"]] == [f"10.50.0.{20 + i}" for i in range(3)]
    assert [p["connection_count"] for p in database["peers"]] == [20, 40, 60]
    assert database["services"][0]["port"] == 5432 and database["first_seen"] < database["last_seen"]
    assert answer["address_group_evidence"][0]["unseen_addresses_admitted"] == 0
    ports = {s["port"] for ruleset in answer["rulesets"] for r in ruleset["rules"] for s in r["services"]}
    assert ports == {22, 5432}  # only the listening ports: no client's port
    assert (
        answer["not_generalised"] == [] and answer["admitted_now"] == [] and answer["admitted_now_count"] == 0
    )


def test_the_draft_saved_as_it_is_reads_back_as_proposed(fleet):
    server, clients = fleet
    _scenario(server, clients)
    answer = _suggest(server, label_keys=["app"])
    names = {}
    for group in answer["address_groups"]:
        names[str(services.address_group_create(actor=CLI_ACTOR, data=group).id)] = group["name"]
    saved = ruleset_data(services.ruleset_create(actor=CLI_ACTOR, data=answer["draft"]))
    assert saved["scope"] == answer["draft"]["scope"]
    read = [
        {"sources": [({"address_group": names[s["address_group"]]} if "address_group" in s else s)
                     for s in rule["sources"]], "services": rule["services"]}
        for rule in saved["rules"]
    ]  # fmt: skip
    assert read == [{"sources": r["sources"], "services": r["services"]} for r in answer["draft"]["rules"]]
    # Saved, it admits exactly what it was learnt from: asked again, nothing is left to propose.
    again = _suggest(server, label_keys=["app"])
    assert again["rulesets"] == [] and again["not_generalised"] == []
    total = sum(r["connection_count"] for r in answer["evidence"][0]["rules"])
    assert sum(row["connection_count"] for row in again["admitted_now"]) == total


def test_names_proposed_are_free_and_a_group_of_exactly_the_addresses_is_reused(fleet):
    server, clients = fleet
    _scenario(server, clients, minutes=1)
    services.ruleset_create(actor=CLI_ACTOR, data={"name": "suggested app=db", "scope": "app=other"})
    services.address_group_create(actor=CLI_ACTOR, data={"name": "bastion", "members": [OUTSIDE]})
    services.address_group_create(
        actor=CLI_ACTOR, data={"name": "suggested app=db peers", "members": ["10.0.0.1"]}
    )
    answer = _suggest(server, label_keys=["app"])
    assert answer["draft"]["name"] == "suggested app=db 2"
    assert answer["address_groups"] == []
    assert answer["draft"]["rules"][0]["sources"] == [{"address_group": "bastion"}]


def test_what_a_rule_in_force_admits_now_is_not_proposed_again(fleet):
    server, clients = fleet
    counts = _scenario(server, clients, minutes=2)
    # in visibility every connection is `observed`, whether a rule would admit it or not
    services.ruleset_create(
        actor=CLI_ACTOR,
        data={"name": "db", "scope": "app=db", "rules": [
            {"sources": [{"selector": "app=web"}], "services": [{"protocol": "tcp", "port": 5000, "port_to": 6000}]}
        ]},
    )  # fmt: skip
    answer = _suggest(server, label_keys=["app"])
    assert [r["services"] for r in answer["draft"]["rules"]] == [[{"protocol": "tcp", "port": 22}]]
    assert sum(row["connection_count"] for row in answer["admitted_now"]) == counts["db"]
    assert answer["evidence"][0]["rules"][0]["connection_count"] == counts["ssh"]


def test_a_workload_without_a_label_key_is_listed_with_its_reason(fleet):
    server, clients = fleet
    _scenario(server, clients, minutes=2)
    answer = _suggest(server, label_keys=["app", "tier"])
    # the server has no `tier`: nothing generalises, every key is listed with why
    assert answer["rulesets"] == [] and answer["draft"] is None
    assert {row["reason"] for row in answer["not_generalised"]} == {"the workload db1 has no label tier"}
    assert sum(row["connection_count"] for row in answer["not_generalised"]) == (1 + 2 + 3 + 2) * 2


def test_peers_seen_on_different_services_get_rules_of_their_own_and_same_ones_share(fleet):
    server, clients = fleet
    other = "198.51.100.8"
    _ingest(server, _traffic(1, lambda _m: [
        {"peer": OUTSIDE, "port": 22}, {"peer": other, "port": 22}, {"peer": other, "port": 80},
        {"peer": "10.50.0.20", "port": 22}, {"peer": "10.50.0.20", "port": 80},
    ]))  # fmt: skip
    rules = _suggest(server, label_keys=["app"])["draft"]["rules"]
    by_services = {tuple(s["port"] for s in r["services"]): r["sources"] for r in rules}
    assert set(by_services) == {(22,), (22, 80)}
    assert len(by_services[(22,)]) == 1 and "address_group" in by_services[(22,)][0]
    assert by_services[(22, 80)][0] == {"selector": "app=web"}
    assert "address_group" in by_services[(22, 80)][1]


def test_aggregation_is_only_when_asked_and_says_what_it_admits_unseen(fleet):
    server, clients = fleet
    _ingest(
        server, _traffic(1, lambda _m: [{"peer": OUTSIDE, "port": 22}, {"peer": "198.51.100.9", "port": 22}])
    )
    exact = _suggest(server, label_keys=["app"])
    assert exact["address_groups"][0]["members"] == [OUTSIDE, "198.51.100.9"]
    wide = _suggest(server, label_keys=["app"], aggregate_prefix=24)
    assert wide["address_groups"][0]["members"] == ["198.51.100.0/24"]
    assert wide["address_group_evidence"][0]["unseen_addresses_admitted"] == 254


def test_ipv6_peers_icmp_and_a_named_service_of_exactly_the_port(fleet):
    server, clients = fleet
    services.service_create(
        actor=CLI_ACTOR, data={"name": "https", "entries": [{"protocol": "tcp", "port": 443}]}
    )
    services.service_create(
        actor=CLI_ACTOR,
        data={"name": "web", "entries": [{"protocol": "tcp", "port": 80}, {"protocol": "tcp", "port": 443}]},
    )
    _ingest(server, _traffic(1, lambda _m: [
        {"peer": "2001:db8::9", "port": 443}, {"peer": "2001:db8::a", "port": 443},
        {"peer": "2001:db8::9", "protocol": "icmpv6", "port": 0}, {"peer": "2001:db8::a", "protocol": "icmpv6", "port": 0},
    ]))  # fmt: skip
    answer = _suggest(server, label_keys=["app"])
    [rule] = answer["draft"]["rules"]
    assert rule["services"] == [{"protocol": "icmpv6"}, {"service": "https"}]
    assert answer["address_groups"][0]["members"] == ["2001:db8::9", "2001:db8::a"]
    wide = _suggest(server, label_keys=["app"], aggregate_prefix=8, aggregate_prefix_v6=64)
    assert wide["address_groups"][0]["members"] == ["2001:db8::/64"]
    assert wide["address_group_evidence"][0]["unseen_addresses_admitted"] == 2**64 - 2


def test_a_gap_in_the_range_makes_it_incomplete_and_names_the_gap(fleet):
    server, clients = fleet
    _scenario(server, clients, minutes=3)
    at = clock.now() - timedelta(minutes=20)
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # noqa: E731
    gap = {"id": str(uuid.uuid4()), "kind": "source_restart", "source": "conntrack",
           "start": text(at), "end": text(at + timedelta(seconds=30)), "lost": {}}  # fmt: skip
    _ingest(server, [], [gap])
    answer = _suggest(server, label_keys=["app"])
    assert answer["complete"] is False and "incomplete" in answer["warning"]
    assert answer["coverage"]["gap_count"] == 1
    [interval] = answer["incomplete_intervals"]
    assert interval["workload_id"] == str(server.id)
    assert interval["reason"] == "evidence gap (source_restart)"
    assert interval["start"].startswith(text(at)[:19])
    assert len(answer["draft"]["rules"]) == 2  # still proposed, said to be incomplete


def test_bad_label_keys_are_findings(fleet):
    server, _ = fleet
    with pytest.raises(ValidationFailed) as raised:
        _suggest(server, label_keys=["bad key"])
    assert raised.value.findings[0].path == "/label_keys/0"
    with pytest.raises(ValidationFailed):
        _suggest(server, label_keys=[])


def test_every_selector_proposed_parses(fleet):
    server, clients = fleet
    _scenario(server, clients, minutes=1)
    answer = _suggest(server)  # the default keys: app
    assert answer["label_keys"] == ["app"]
    for rule in answer["draft"]["rules"]:
        for source in rule["sources"]:
            if "selector" in source:
                assert str(parse_selector(source["selector"])) == source["selector"]


# --- POST /api/v1/policies/suggestions ---


def _body(**extra):
    start, end = _range()
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    return {"from": text(start), "to": text(end), **extra}


def test_the_endpoint_answers_the_same_proposal_and_the_draft_posts_unchanged(api, fleet):
    server, clients = fleet
    counts = _scenario(server, clients)
    response = api.post(
        "/api/v1/policies/suggestions", _body(label=["app=db"], label_keys=["app"]), format="json"
    )
    assert response.status_code == 200, response.content
    answer = response.json()
    assert [len(r["rules"]) for r in answer["rulesets"]] == [2]
    assert sum(r["connection_count"] for r in answer["evidence"][0]["rules"]) == counts["db"] + counts["ssh"]
    for group in answer["address_groups"]:
        assert api.post("/api/v1/address-groups", group, format="json").status_code == 201
    saved = api.post("/api/v1/rulesets", answer["draft"], format="json")
    assert saved.status_code == 201, saved.content
    assert [r["services"] for r in saved.json()["rules"]] == [r["services"] for r in answer["draft"]["rules"]]
    # by workload id too: saved, the draft admits everything it was learnt from
    again = api.post("/api/v1/policies/suggestions", _body(workload=[str(server.id)]), format="json").json()
    assert again["label_keys"] == ["app"] and again["draft"] is None
    assert sum(row["connection_count"] for row in again["admitted_now"]) == counts["db"] + counts["ssh"]


def test_bad_bodies_are_validation_problems_with_every_finding(api, db):
    body = assert_problem(
        api.post(
            "/api/v1/policies/suggestions",
            {
                "from": "yesterday",
                "label": ["app in ()"],
                "label_keys": ["a b"],
                "aggregate_prefix": 33,
                "x": 1,
            },
            format="json",
        ),
        422,
        "validation",
    )
    paths = {f["path"] for f in body["errors"]}
    assert paths == {"/x", "/from", "/to", "/label/0", "/label_keys/0", "/aggregate_prefix"}, body
    assert_problem(api.post("/api/v1/policies/suggestions", [], format="json"), 422, "validation")
    assert_problem(
        api.post("/api/v1/policies/suggestions", _body(workload=[str(uuid.uuid4())]), format="json"),
        404,
        "not-found",
    )


def test_the_endpoint_runs_on_the_heavy_pool():
    from controlplane.http_threads import HEAVY_PATHS

    assert "/api/v1/policies/suggestions" in HEAVY_PATHS


# --- manage.py policy suggest ---


def _cli_range():
    body = _body()
    return ["--from", body["from"], "--to", body["to"]]


def test_suggest_json_is_a_draft_that_ruleset_create_reads_from_stdin(api, fleet, monkeypatch):
    server, clients = fleet
    _scenario(server, clients, minutes=3)
    args = ["policy", "suggest", *_cli_range(), "--label", "app=db", "--label-key", "app"]
    code, out, _ = run_command(*args, "--answer")
    assert code == 0
    for group in json.loads(out)["address_groups"]:
        code, _, err = run_command(
            "address-group", "create", "-", stdin_text=json.dumps(group), monkeypatch=monkeypatch
        )
        assert code == 0, err
    code, draft, err = run_command(*args, "--json")
    assert code == 0 and err == "", err
    code, created, err = run_command(
        "ruleset", "create", "-", "--json", stdin_text=draft, monkeypatch=monkeypatch
    )
    assert code == 0, err
    saved = api.get(f"/api/v1/rulesets/{json.loads(created)['id']}").json()
    assert saved["scope"] == "app=db"
    assert [r["services"] for r in saved["rules"]] == [
        [{"protocol": "tcp", "port": 22}],
        [{"protocol": "tcp", "port": 5432}],
    ]


def test_suggest_in_words_and_its_refusals(fleet):
    server, clients = fleet
    _scenario(server, clients, minutes=2)
    code, out, err = run_command("policy", "suggest", *_cli_range(), "--workload", str(server.id))
    assert code == 0 and err == ""
    assert "ruleset suggested app=db  scope app=db" in out
    assert "from app=web to tcp/5432: 12 connections from 3 peers" in out
    code, _, err = run_command("policy", "suggest", *_cli_range(), "--label-key", "nope key")
    assert code == 2 and err.startswith("error: /label_keys/0: ") and len(err.strip().splitlines()) == 1
    # nothing generalises (the server has no tier): a one-line error, after the coverage warning
    only_server = ["--workload", str(server.id), "--label-key", "app", "--label-key", "tier"]
    code, _, err = run_command("policy", "suggest", *_cli_range(), "--json", *only_server)
    assert code == 1 and err.splitlines()[-1].startswith("error: nothing to propose"), err
    # two scopes, one draft asked for: a one-line error naming them
    cache = _labelled("cache1", "10.50.0.40", {"app": "cache"})
    _ingest(cache, _traffic(1, lambda _m: [{"peer": "10.50.0.20", "port": 6379}]))
    code, _, err = run_command("policy", "suggest", *_cli_range(), "--json", "--label", "app in (cache,db)")
    assert code == 1
    assert (
        err.splitlines()[-1]
        == "error: the evidence has 2 scopes (app=cache, app=db): select one with --label"
    )


def test_suggest_says_prominently_when_the_range_is_incomplete(fleet):
    server, clients = fleet
    _scenario(server, clients, minutes=1)
    # the clients sent no window: the whole fleet's range is incomplete
    code, out, err = run_command("policy", "suggest", *_cli_range(), "--json")
    assert code == 0 and json.loads(out)["scope"] == "app=db"
    assert err.startswith("warning: The range is incomplete")
    assert f"{clients[0].id}: no flow window in the range" in err


# --- "admitted now" is the classifier's judgement (flows/policy_drafts/classifier.py) ---


def test_a_selector_source_admits_by_the_fleets_addresses_now_as_the_table_does(fleet):
    server, clients = fleet
    late = "10.50.0.30"
    # seen before any workload had the address: stored without a peer workload
    _ingest(server, _traffic(2, lambda _m: [{"peer": late, "port": 5432, "connection_count": 3}]))
    _labelled("web9", late, {"app": "web"})
    services.ruleset_create(
        actor=CLI_ACTOR,
        data={"name": "db", "scope": "app=db", "rules": [
            {"sources": [{"selector": "app=web"}], "services": [{"protocol": "tcp", "port": 5432}]}
        ]},
    )  # fmt: skip
    answer = _suggest(server, label_keys=["app"])
    # the server's table now admits the address by the selector (it is web9's): nothing to propose,
    # where a match on the key's recorded peer workload (none) would propose the address again
    assert answer["rulesets"] == [] and answer["address_groups"] == []
    [key] = answer["admitted_now"]
    assert (key["peer"], key["peer_workload_id"], key["connection_count"]) == (late, None, 6)


def _random_policy(rng, outside):
    """A few rulesets of random scopes, sources (selectors, address groups of hosts and CIDRs, any)
    and services (ports, ranges, icmp, icmpv6), some disabled."""
    groups = []
    for i in range(2):
        members = rng.sample([*outside, "198.51.100.0/28", "2001:db8:5::/64", "10.50.0.0/30"], 2)
        groups.append(
            services.address_group_create(actor=CLI_ACTOR, data={"name": f"g{i}", "members": members})
        )
    entries = [
        {"protocol": "tcp", "port": 5432}, {"protocol": "tcp", "port": 20, "port_to": 25},
        {"protocol": "udp", "port": 53}, {"protocol": "icmp"}, {"protocol": "icmpv6"},
        {"protocol": "tcp", "port": 1000, "port_to": 6000},
    ]  # fmt: skip
    sources = [
        {"selector": "app=web"},
        {"selector": "tier=t1"},
        {"selector": "app in (web,db)"},
        {"any": True},
        *({"address_group": g.name} for g in groups),
    ]
    for i in range(rng.randint(1, 3)):
        rules = [
            {
                "sources": rng.sample(sources, rng.randint(1, 3)),
                "services": rng.sample(entries, rng.randint(1, 3)),
            }
            for _ in range(rng.randint(1, 4))
        ]
        scope = rng.choice(["app=db", "", "app=web", "app in (db,web)"])
        services.ruleset_create(
            actor=CLI_ACTOR,
            data={"name": f"r{i}", "scope": scope, "enabled": rng.random() < 0.8, "rules": rules},
        )


@pytest.mark.parametrize("seed", range(6))
def test_admitted_now_is_what_the_classifier_admits_for_every_key(fleet, seed):
    """Random keys (IPv4 and IPv6, tcp, udp, icmp, icmpv6; a peer whose address became a workload's
    after the keys were stored) under a random policy: the keys left out as admitted now are exactly
    those the server's table, in `simulation`, would admit by a rule."""
    import random

    from fleet.rendering import fleet_load
    from policy.classify import Connection, classify
    from policy.selectors import policy_inputs_load

    rng = random.Random(seed)
    server, clients = fleet
    _labelled("web6", "2001:db8::20", {"app": "web", "tier": "t1"})
    outside = ["198.51.100.3", "198.51.100.77", "2001:db8:5::9", "2001:db8:7::1"]
    late = "10.50.0.31"  # a workload's address only after the keys were stored: no peer workload
    peers4 = [f"10.50.0.{20 + i}" for i in range(3)] + [late] + outside[:2]
    peers6 = ["2001:db8::20", *outside[2:]]
    keys = set()
    for _ in range(30):
        protocol = rng.choice(["tcp", "tcp", "udp", "icmp", "icmpv6"])
        peer = rng.choice(
            peers6 if protocol == "icmpv6" else peers4 if protocol == "icmp" else peers4 + peers6
        )
        port = 0 if protocol.startswith("icmp") else rng.choice([22, 23, 53, 443, 5432, 6379, 8080])
        keys.add((peer, protocol, port))
    _ingest(
        server, _traffic(1, lambda _m: [{"peer": p, "protocol": pr, "port": n} for p, pr, n in sorted(keys)])
    )
    _labelled("web-late", late, {"app": "web"})
    _random_policy(rng, outside)

    fleet_index, inputs = fleet_load()
    now = policy_inputs_load()
    assert inputs[str(server.id)].mode == "visibility"  # no rules installed: judged as its rules would
    judged = dataclasses.replace(inputs[str(server.id)], mode="simulation")

    def admits(peer, protocol, port):
        connection = Connection(peer, protocol, port if protocol in ("tcp", "udp") else None)
        return classify(judged, now.rulesets, now.groups, fleet_index, connection).rule is not None

    answer = _suggest(server, label_keys=["app"])
    listed = {(k["peer"], k["service"]["protocol"], k["service"]["port"]) for k in answer["admitted_now"]}
    assert answer["admitted_now_count"] == len(listed)
    assert listed == {key for key in keys if admits(*key)}


def test_what_a_deny_rule_refuses_is_listed_as_refused_by_it_never_learnt(fleet):
    server, clients = fleet
    counts = _scenario(server, clients, minutes=2)
    blocklist = services.ruleset_create(
        actor=CLI_ACTOR,
        data={"name": "blocklist", "scope": "app=db", "rules": [
            {"action": "deny", "sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 22}]}
        ]},
    )  # fmt: skip
    number = blocklist.rules.get().number
    answer = _suggest(server, label_keys=["app"])
    # Only the allow the evidence asks for; the refused ssh is neither proposed nor admitted now.
    assert [r["services"] for r in answer["draft"]["rules"]] == [[{"protocol": "tcp", "port": 5432}]]
    assert all(r.get("action", "allow") == "allow" for rs in answer["rulesets"] for r in rs["rules"])
    refused = [k for k in answer["not_generalised"] if k.get("rule_number") == number]
    assert sum(k["connection_count"] for k in refused) == counts["ssh"]
    assert {k["reason"] for k in refused} == {f"refused by deny rule {number}"}
    assert answer["admitted_now"] == []

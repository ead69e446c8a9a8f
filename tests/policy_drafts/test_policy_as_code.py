"""Policy as code: export, plan and apply (flows/policy_drafts/as_code/, `manage.py policy export|plan|apply`)."""

from __future__ import annotations

import json
import uuid

import pytest
from django.core.management import CommandError
from django.db import connection, transaction

from controlplane.auth.actor import CLI_ACTOR
from controlplane.models import AuditEvent
from controlplane.problems import Problem
from fleet.models import RenderedPolicy, Workload
from flows.policy_drafts.as_code.apply import policy_apply
from flows.policy_drafts.as_code.format import file_path, policy_export, policy_file_load, policy_version_lock
from flows.policy_drafts.as_code.parse import PolicyFileInvalid
from flows.policy_drafts.as_code.plan import policy_plan
from policy import services as writes
from policy.models import AddressGroup, PolicyState, Rule, Ruleset, Service
from policy.selectors import policy_version
from tests.support.helpers import race
from tests.support.helpers import run_command as run
from tests.support.requirements import require
from tests.support.workloads import make_workload

EMPTY = {"version": 1, "services": [], "address_groups": [], "rulesets": []}


@pytest.fixture
def fleet(db):
    """Workloads with IPv4 and IPv6 addresses, in every mode, that the policy's selectors pick."""
    specs = [
        ("web-1", {"app": "web", "env": "prod"}, ["10.0.1.1", "2001:db8:1::1"], "enforced"),
        ("web-2", {"app": "web", "env": "staging"}, ["10.0.1.2"], "simulation"),
        ("db-1", {"app": "db", "env": "prod"}, ["10.0.2.1", "2001:db8:2::1"], "enforced"),
        ("client-1", {"role": "client"}, ["10.0.3.1", "2001:db8:3::1"], "simulation"),
        ("monitor-1", {"role": "monitor"}, ["fd00::4"], "enforced"),
        ("quiet-1", {"app": "web"}, ["10.0.5.1"], "visibility"),
    ]
    return [make_workload(hostname=h, labels=labels, addresses=a, mode=m) for h, labels, a, m in specs]


def _messy_policy():
    """A policy with a history: rulesets created out of name order, rules added, removed, reordered
    and edited, so lifetime numbers have gaps and are not in ruleset-name order."""
    actor = CLI_ACTOR
    writes.service_create(
        actor=actor,
        data={
            "name": "web",
            "description": 'HTTP(S) and the "app" range, Büro',
            "entries": [
                {"protocol": "tcp", "port": 443},
                {"protocol": "tcp", "port": 80},
                {"protocol": "tcp", "port": 8000, "port_to": 8100},
            ],
        },
    )
    writes.service_create(
        actor=actor,
        data={"name": "dns", "entries": [{"protocol": "udp", "port": 53}, {"protocol": "tcp", "port": 53}]},
    )
    writes.service_create(
        actor=actor, data={"name": "ping", "entries": [{"protocol": "icmp"}, {"protocol": "icmpv6"}]}
    )
    writes.address_group_create(
        actor=actor,
        data={"name": "office", "members": ["192.0.2.0/24", "2001:db8:ff::/48", "198.51.100.7"]},
    )
    writes.address_group_create(actor=actor, data={"name": "legacy", "members": ["203.0.113.0/24"]})
    db = writes.ruleset_create(
        actor=actor,
        data={
            "name": "zz-database",
            "scope": "app=db",
            "rules": [
                {"sources": [{"selector": "app=web"}], "services": [{"protocol": "tcp", "port": 5432}]},
                {"sources": [{"address_group": "office"}], "services": [{"service": "ping"}]},
            ],
        },
    )
    frontend = writes.ruleset_create(
        actor=actor,
        data={
            "name": "frontend",
            "description": "who may reach the web tier",
            "scope": "app=web",
            "rules": [
                {
                    "description": "clients",
                    "sources": [{"selector": "role=client"}],
                    "services": [{"service": "web"}],
                },
                {"sources": [{"any": True}], "services": [{"protocol": "icmpv6"}]},
            ],
        },
    )
    writes.rule_add(
        actor=actor,
        ruleset_id=str(frontend.id),
        data={
            "sources": [{"address_group": "office"}, {"selector": "role=monitor"}],
            "services": [{"service": "dns"}, {"protocol": "udp", "port": 161, "port_to": 162}],
        },
    )
    doomed = writes.rule_add(
        actor=actor,
        ruleset_id=str(frontend.id),
        data={"sources": [{"any": True}], "services": [{"protocol": "icmp"}]},
    )
    frontend.refresh_from_db()
    writes.rule_delete(
        actor=actor, ruleset_id=str(frontend.id), rule_id=str(doomed.id), expected_version=str(doomed.version)
    )
    # Reordered: the last rule first.
    current = [r for r in Rule.objects.filter(ruleset=frontend).order_by("position")]
    frontend.refresh_from_db()
    writes.ruleset_replace(
        actor=actor,
        ruleset_id=str(frontend.id),
        expected_version=str(frontend.version),
        data={
            "name": "frontend",
            "description": "who may reach the web tier",
            "scope": "app=web",
            "rules": [{"id": str(current[-1].id), **_rule_body(current[-1])}]
            + [{"id": str(r.id), **_rule_body(r)} for r in current[:-1]],
        },
    )
    edited = Rule.objects.get(ruleset=db, position=0)
    writes.rule_replace(
        actor=actor,
        ruleset_id=str(db.id),
        rule_id=str(edited.id),
        expected_version=str(edited.version),
        data={
            "sources": [{"selector": "app=web"}],
            "services": [{"protocol": "tcp", "port": 5432}, {"protocol": "tcp", "port": 6432}],
        },
    )
    writes.ruleset_create(
        actor=actor,
        data={
            "name": "break-glass",
            "enabled": False,
            "scope": "",
            "rules": [{"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 22}]}],
        },
    )
    assert db.rules.count() == 2


def _rule_body(rule):
    from policy.representations import rule_data

    data = rule_data(rule)
    return {k: data[k] for k in ("description", "sources", "services")}


def _documents() -> dict[str, tuple[str, dict]]:
    rows = Workload.objects.values_list("hostname", "latest_policy_id")
    stored = {p.version: p for p in RenderedPolicy.objects.filter(version__in=[v for _, v in rows])}
    return {host: (stored[v].document, stored[v].rule_index) for host, v in rows}


def _apply(data, *, prune=False, source="policy.yaml"):
    return policy_apply(
        actor=CLI_ACTOR, data=data, prune=prune, expected_version=str(policy_version()), source=source
    )


def _counts():
    return (
        Service.objects.count(),
        AddressGroup.objects.count(),
        Ruleset.objects.count(),
        Rule.objects.count(),
    )


def _empty_control_plane():
    """A fresh install's policy with the same fleet: no policy object, the policy state row as new
    (version 1, rule numbers from 1). The documents render empty through the domain first."""
    _apply(EMPTY, prune=True)
    assert _counts() == (0, 0, 0, 0)
    PolicyState.objects.filter(id=1).update(version=1, next_rule_number=1)


def _versions() -> dict[str, str]:
    return dict(Workload.objects.values_list("hostname", "latest_policy_id"))


@pytest.fixture
def dryrun_seen(monkeypatch):
    """The render dry-runs the plans make, each workload's hypothetical version."""
    from flows.policy_drafts.as_code import plan

    seen: list[dict[str, str]] = []
    real = plan.render_dryrun

    def spy(**kwargs):
        answer = real(**kwargs)
        hosts = dict(Workload.objects.values_list("id", "hostname"))
        seen.append(
            {hosts[uuid.UUID(c["workload_id"])]: c["hypothetical_version"] for c in answer["changed"]}
        )
        return answer

    monkeypatch.setattr(plan, "render_dryrun", spy)
    return seen


def test_export_to_an_empty_control_plane_renders_every_document_byte_identically(fleet, dryrun_seen):
    _messy_policy()
    original, documents = _versions(), _documents()
    assert any("@grp_" in doc for doc, _ in documents.values()) and any(
        "ip6 saddr" in doc for doc, _ in documents.values()
    )
    exported = policy_export(format="yaml")
    assert "id:" not in exported and "version: 1\n" == exported.splitlines(True)[0]
    assert "created_at" not in exported
    data = policy_file_load(text=exported, source="policy.yaml")
    numbers = [rule["number"] for ruleset in data["rulesets"] for rule in ruleset["rules"]]
    assert all(list(rule)[0] == "number" for ruleset in data["rulesets"] for rule in ruleset["rules"])
    # Not the numbers a fresh control plane would give in apply order: the test would prove nothing.
    assert numbers != list(range(1, len(numbers) + 1))
    assert sorted(numbers) == sorted(Rule.objects.values_list("number", flat=True))

    _empty_control_plane()
    protected = {h for h, (_, rule_index) in documents.items() if rule_index}
    assert protected == {"web-1", "web-2", "db-1"}
    assert all(original[h] != v for h, v in _versions().items() if h in protected)

    plan = policy_plan(data=data, prune=True)
    assert plan["render"]["changed_count"] == len(protected)
    assert dryrun_seen[-1] == {h: original[h] for h in protected}  # the dry-run numbers as apply will
    _apply(data, prune=True)
    assert _versions() == original  # the same version hash: byte-identical, no mapping of numbers
    assert {h: doc for h, (doc, _) in _documents().items()} == {h: doc for h, (doc, _) in documents.items()}
    assert policy_export(format="yaml") == exported
    assert policy_plan(data=data, prune=True)["changes"] == [] and policy_plan(data=data)["changes"] == []
    assert PolicyState.objects.get(id=1).next_rule_number == max(numbers) + 1


def test_a_file_without_numbers_gets_fresh_numbers_in_apply_order(fleet, dryrun_seen):
    """A hand-written file (no numbers): rules are numbered from the next number, in the order of
    the apply (rulesets by name, rules in order); on two fresh control planes that is the same."""
    _messy_policy()
    data = policy_file_load(text=policy_export(format="json"), source="policy.json")
    for ruleset in data["rulesets"]:
        for rule in ruleset["rules"]:
            del rule["number"]
    _empty_control_plane()
    before = _versions()
    policy_plan(data=data)
    _apply(data)
    first = _versions()
    assert {h: v for h, v in first.items() if before[h] != v} == dryrun_seen[-1]
    expected = [
        (name, i)
        for name, count in (("break-glass", 1), ("frontend", 3), ("zz-database", 2))
        for i in range(count)
    ]
    got = list(Rule.objects.order_by("number").values_list("ruleset__name", "position"))
    assert got == expected and Rule.objects.order_by("number").first().number == 1
    assert policy_plan(data=data)["changes"] == []  # unnumbered rules match by content
    _empty_control_plane()
    _apply(data)
    assert _versions() == first


def test_requested_numbers_and_fresh_ones_are_numbered_by_the_plan_as_by_the_apply(fleet, dryrun_seen):
    _messy_policy()
    data = policy_file_load(text=policy_export(format="yaml"), source="p.yaml")
    next_number = PolicyState.objects.get(id=1).next_rule_number
    frontend = data["rulesets"][1]
    new = {"sources": [{"selector": "role=monitor"}], "services": [{"protocol": "tcp", "port": 9100}]}
    frontend["rules"].insert(0, dict(new))  # unnumbered: past the numbers the file asks for
    frontend["rules"].append(
        {"number": next_number + 40, **new, "services": [{"protocol": "tcp", "port": 9200}]}
    )
    data["rulesets"].append(
        {"name": "aa-new", "enabled": True, "scope": "app=db", "rules": [{"number": next_number + 7, **new}]}
    )
    # A numbered rule is never matched by content: the same content under a new number is a new rule.
    database = data["rulesets"][2]  # zz-database
    database["rules"][1] = {**database["rules"][1], "number": next_number + 20}
    plan = policy_plan(data=data)
    assert not any(f["field"].endswith(".number") for c in plan["changes"] for f in c["fields"])
    assert [(f["field"], f["action"]) for f in plan["changes"][-1]["fields"]] == [
        ("rules[1]", "add"),
        ("rules[1]", "remove"),
    ]
    before = _versions()
    _apply(data)
    changed = {h: v for h, v in _versions().items() if before[h] != v}
    assert changed == dryrun_seen[-1] and len(changed) == plan["render"]["changed_count"] > 0
    numbers = dict(Rule.objects.filter(ruleset__name="frontend").values_list("position", "number"))
    assert numbers[0] == next_number + 41 and numbers[4] == next_number + 40
    assert Rule.objects.get(ruleset__name="aa-new").number == next_number + 7
    assert Rule.objects.get(ruleset__name="zz-database", position=1).number == next_number + 20
    assert PolicyState.objects.get(id=1).next_rule_number == next_number + 42
    assert policy_plan(data=data)["changes"] == []
    again = policy_file_load(text=policy_export(format="yaml"), source="p.yaml")
    assert [r["name"] for r in again["rulesets"]][:3] == ["aa-new", "break-glass", "frontend"]
    assert again["rulesets"][2]["rules"][0]["number"] == next_number + 41


def test_a_numbered_rule_edited_on_both_sides_keeps_its_number(fleet):
    _messy_policy()
    data = policy_file_load(text=policy_export(format="yaml"), source="p.yaml")
    rules = data["rulesets"][1]["rules"]  # frontend
    edited = rules.pop(0)  # office + monitor on dns, snmp
    stored = Rule.objects.get(number=edited["number"])
    edited["sources"] = [{"selector": "role=client"}, {"address_group": "legacy"}]
    edited["services"] = [{"protocol": "tcp", "port": 8443}]
    rules.append(edited)  # and moved: no content, side or position would match it
    fields = policy_plan(data=data)["changes"][0]["fields"]
    assert [(f["field"], f["action"]) for f in fields] == [
        ("rules[2].sources", "change"),
        ("rules[2].services", "change"),
        ("rules", "reorder"),
    ]
    _apply(data)
    kept = Rule.objects.get(number=edited["number"])
    assert kept.id == stored.id and kept.position == 2  # the same rule: its evidence stays its own
    assert policy_plan(data=data)["changes"] == []

    # Without its number, the same rule edited again and moved is a new one: nothing else tells.
    del edited["number"]
    rules.remove(edited)
    rules.insert(0, edited)
    edited["sources"], edited["services"] = [{"any": True}], [{"protocol": "udp", "port": 514}]
    fields = policy_plan(data=data)["changes"][0]["fields"]
    assert [(f["field"], f["action"]) for f in fields] == [("rules[0]", "add"), ("rules[2]", "remove")]


NUMBERED_FILE_RULESETS = [
    {
        "name": "frontend",
        "scope": "app=web",
        "rules": [
            {"number": "7", "sources": [{"any": True}], "services": [{"protocol": "icmp"}]},
            {"number": True, "sources": [{"any": True}], "services": [{"protocol": "icmp"}]},
            {"number": 0, "sources": [{"any": True}], "services": [{"protocol": "icmp"}]},
            {"number": 1 << 24, "sources": [{"any": True}], "services": [{"protocol": "icmp"}]},
            {"number": "DB", "sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 1}]},
            {"number": "GONE", "sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 2}]},
            {"number": "FRESH", "sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 3}]},
        ],
    },
    {
        "name": "other",
        "scope": "",
        "rules": [
            {"number": "FRESH", "sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 4}]},
            {
                "number": (1 << 24) - 1,
                "sources": [{"any": True}],
                "services": [{"protocol": "tcp", "port": 5}],
            },
        ],
    },
]


def test_bad_numbers_get_every_finding_with_its_path_and_nothing_is_written(fleet):
    _messy_policy()
    db_rule = Rule.objects.filter(ruleset__name="zz-database").first().number
    gone = sorted(
        set(range(1, PolicyState.objects.get(id=1).next_rule_number))
        - set(Rule.objects.values_list("number", flat=True))
    )[0]
    fresh = PolicyState.objects.get(id=1).next_rule_number + 5
    data = policy_file_load(text=policy_export(format="json"), source="p.json")
    rulesets = json.loads(
        json.dumps(NUMBERED_FILE_RULESETS)
        .replace('"DB"', str(db_rule))
        .replace('"GONE"', str(gone))
        .replace('"FRESH"', str(fresh))
    )
    data["rulesets"] = [r for r in data["rulesets"] if r["name"] != "frontend"] + rulesets
    database = data["rulesets"][1]  # its rule moved to another ruleset, number and all
    database["rules"] = [r for r in database["rules"] if r["number"] != db_rule]
    before, events, state = _counts(), AuditEvent.objects.count(), PolicyState.objects.get(id=1)
    for call in (lambda: policy_plan(data=data), lambda: _apply(data)):
        with pytest.raises(PolicyFileInvalid) as invalid:
            call()
        found = [(file_path(f.path), f.rule, f.message) for f in invalid.value.findings]
        assert [(path, rule) for path, rule, _ in found] == [
            ("rulesets[2].rules[0].number", "type"),
            ("rulesets[2].rules[1].number", "type"),
            ("rulesets[2].rules[2].number", "out-of-range"),
            ("rulesets[2].rules[3].number", "out-of-range"),
            ("rulesets[3].rules[0].number", "duplicate-number"),
            ("rulesets[2].rules[4].number", "rule-of-another-ruleset"),
            ("rulesets[2].rules[5].number", "number-given"),
        ]
        assert found[4][2].endswith("(also rulesets[2].rules[6].number): a number is one rule.")
        assert found[5][2] == (
            f"rule {db_rule} belongs to ruleset 'zz-database'; a rule cannot move between rulesets: "
            "remove its number to create a new rule there."
        )
        assert found[6][2] == (
            f"number {gone} was given to a rule since deleted; numbers are never reused, so flow evidence "
            "of the old rule is never attributed to a new one: remove `number` to create a new rule."
        )
    assert _counts() == before and AuditEvent.objects.count() == events
    after = PolicyState.objects.get(id=1)
    assert (after.version, after.next_rule_number) == (state.version, state.next_rule_number)


def test_the_highest_number_the_mark_holds_is_admitted(db):
    data = {
        **EMPTY,
        "rulesets": [
            {
                "name": "r",
                "enabled": True,
                "scope": "",
                "rules": [
                    {"number": (1 << 24) - 1, "sources": [{"any": True}], "services": [{"protocol": "icmp"}]}
                ],
            }
        ],
    }
    _apply(data)
    assert Rule.objects.get().number == (1 << 24) - 1
    assert policy_file_load(text=policy_export(format="yaml"), source="p.yaml") == data
    more = {"sources": [{"any": True}], "services": [{"protocol": "icmpv6"}]}
    data["rulesets"][0]["rules"].append(more)
    with pytest.raises(PolicyFileInvalid, match="rule numbers have been given out"):
        _apply(data)
    assert Rule.objects.count() == 1


def test_export_is_sorted_named_and_byte_identical(fleet):
    _messy_policy()
    first, second = policy_export(format="yaml"), policy_export(format="yaml")
    assert first == second
    data = policy_file_load(text=policy_export(format="json"), source="p.json")
    assert data == policy_file_load(text=first, source="p.yaml")
    assert list(data) == ["version", "services", "address_groups", "rulesets"]
    assert [s["name"] for s in data["services"]] == ["dns", "ping", "web"]
    assert [r["name"] for r in data["rulesets"]] == ["break-glass", "frontend", "zz-database"]
    frontend = data["rulesets"][1]
    assert frontend["rules"][0]["sources"] == [{"address_group": "office"}, {"selector": "role=monitor"}]
    assert frontend["rules"][0]["services"] == [
        {"service": "dns"},
        {"protocol": "udp", "port": 161, "port_to": 162},
    ]
    assert frontend["rules"][1]["description"] == "clients"
    assert data["services"][2]["entries"][2] == {"protocol": "tcp", "port": 8000, "port_to": 8100}
    assert first.isascii()  # other characters escaped: safe on a terminal, stable in any tool


def test_plan_lists_changes_field_by_field_and_apply_does_exactly_that(fleet):
    _messy_policy()
    data = policy_file_load(text=policy_export(format="yaml"), source="p.yaml")
    rules_before = {r.description: r.number for r in Rule.objects.filter(ruleset__name="frontend")}
    frontend = data["rulesets"][1]
    frontend["scope"] = "app=web,env=prod"
    frontend["rules"].insert(
        0, {"sources": [{"selector": "role=monitor"}], "services": [{"protocol": "tcp", "port": 9100}]}
    )
    frontend["rules"].pop()  # the icmpv6 rule
    data["address_groups"][1]["members"] = ["192.0.2.0/24", "2001:db8:ff::/48", "198.51.100.8"]
    data["services"].append({"name": "ntp", "entries": [{"protocol": "udp", "port": 123}]})
    documents_before = dict(Workload.objects.values_list("hostname", "latest_policy_id"))

    plan = policy_plan(data=data)
    summary = [(c["action"], c["type"], c["name"]) for c in plan["changes"]]
    assert summary == [
        ("create", "service", "ntp"),
        ("change", "address_group", "office"),
        ("change", "ruleset", "frontend"),
    ]
    fields = {f["field"]: f for f in plan["changes"][2]["fields"]}
    assert fields["scope"]["old"] == "app=web" and fields["scope"]["new"] == "app=web,env=prod"
    assert fields["rules[0]"]["action"] == "add"
    assert fields["rules[2]"]["action"] == "remove" and fields["rules[2]"]["old"]["services"] == [
        {"protocol": "icmpv6"}
    ]
    assert plan["changes"][1]["fields"] == [
        {
            "field": "members",
            "action": "change",
            "old": ["192.0.2.0/24", "198.51.100.7", "2001:db8:ff::/48"],
            "new": ["192.0.2.0/24", "198.51.100.8", "2001:db8:ff::/48"],
        }
    ]
    assert plan["kept"] == [] and plan["policy_version"] == str(policy_version())
    assert plan["impact"]["coverage"] is not None and "newly_refused_summary" in plan["impact"]

    applied = policy_apply(
        actor=CLI_ACTOR, data=data, expected_version=plan["policy_version"], source="repo/policy.yaml"
    )
    assert applied["changes"] == plan["changes"]
    moved = {
        h for h, v in Workload.objects.values_list("hostname", "latest_policy_id") if documents_before[h] != v
    }
    assert len(moved) == plan["render"]["changed_count"] > 0
    # The rules the file kept keep their lifetime numbers (flow evidence stays attributed to them).
    rules_after = {r.description: r.number for r in Rule.objects.filter(ruleset__name="frontend")}
    assert rules_after["clients"] == rules_before["clients"]
    assert policy_plan(data=data)["changes"] == []


def test_unnumbered_rules_reordered_and_edited_keep_their_numbers(fleet):
    _messy_policy()
    data = policy_file_load(text=policy_export(format="yaml"), source="p.yaml")
    numbers = [r.number for r in Rule.objects.filter(ruleset__name="frontend").order_by("position")]
    rules = data["rulesets"][1]["rules"]
    for rule in rules:  # as written by hand: the content and position heuristics find them
        del rule["number"]
    rules.reverse()
    rules[0]["services"] = [{"protocol": "icmpv6"}, {"protocol": "icmp"}]  # was the last: icmpv6 alone
    fields = policy_plan(data=data)["changes"][0]["fields"]
    assert fields == [
        {
            "field": "rules[0].services",
            "action": "change",
            "old": [{"protocol": "icmpv6"}],
            "new": [{"protocol": "icmpv6"}, {"protocol": "icmp"}],
        },
        {"field": "rules", "action": "reorder", "old": [0, 1, 2], "new": [2, 1, 0]},
    ]
    _apply(data)
    after = [r.number for r in Rule.objects.filter(ruleset__name="frontend").order_by("position")]
    assert after == list(reversed(numbers))
    assert policy_plan(data=data)["changes"] == []


def test_each_change_is_an_audit_event_naming_the_file(fleet):
    _messy_policy()
    data = policy_file_load(text=policy_export(format="yaml"), source="p.yaml")
    data["services"][0]["description"] = "resolvers"
    data["rulesets"][0]["enabled"] = True
    data["address_groups"] = [g for g in data["address_groups"] if g["name"] != "legacy"]
    seen = AuditEvent.objects.count()
    answer = _apply(data, prune=True, source="git/policy.yaml")
    events = list(AuditEvent.objects.order_by("id")[seen:])
    assert [(e.action, e.object_name) for e in events] == [
        ("service.replace", "dns"),
        ("ruleset.replace", "break-glass"),
        ("address_group.delete", "legacy"),
    ]
    assert answer["applied"] == 3
    assert all(e.detail["source"] == "git/policy.yaml" and e.actor_kind == "cli" for e in events)


def test_without_prune_absent_objects_are_kept_and_listed_with_prune_deleted(fleet):
    _messy_policy()
    data = policy_file_load(text=policy_export(format="yaml"), source="p.yaml")
    # A rename is a delete and a create: "dns" becomes "domain" and the rule follows it.
    data["services"][0]["name"] = "domain"
    data["rulesets"][1]["rules"][0]["services"][0] = {"service": "domain"}
    data["rulesets"] = [r for r in data["rulesets"] if r["name"] != "zz-database"]
    data["address_groups"] = [g for g in data["address_groups"] if g["name"] != "legacy"]

    kept = policy_plan(data=data)
    assert [(c["action"], c["name"]) for c in kept["changes"]] == [
        ("create", "domain"),
        ("change", "frontend"),
    ]
    assert kept["kept"] == [
        {"type": "service", "name": "dns"},
        {"type": "address_group", "name": "legacy"},
        {"type": "ruleset", "name": "zz-database"},
    ]
    _apply(data)
    assert set(Service.objects.values_list("name", flat=True)) == {"dns", "domain", "ping", "web"}
    assert Ruleset.objects.filter(name="zz-database").exists()

    pruned = policy_plan(data=data, prune=True)
    assert [(c["action"], c["type"], c["name"]) for c in pruned["changes"]] == [
        ("delete", "service", "dns"),
        ("delete", "address_group", "legacy"),
        ("delete", "ruleset", "zz-database"),
    ]
    _apply(data, prune=True)
    assert set(Service.objects.values_list("name", flat=True)) == {"domain", "ping", "web"}
    assert set(Ruleset.objects.values_list("name", flat=True)) == {"break-glass", "frontend"}
    assert policy_plan(data=data, prune=True)["changes"] == [] and policy_plan(data=data)["kept"] == []


def test_a_concurrent_edit_between_plan_and_apply_is_refused_and_nothing_is_written(fleet):
    _messy_policy()
    data = policy_file_load(text=policy_export(format="yaml"), source="p.yaml")
    data["services"].append({"name": "ntp", "entries": [{"protocol": "udp", "port": 123}]})
    planned = policy_plan(data=data)["policy_version"]
    writes.service_create(
        actor=CLI_ACTOR, data={"name": "smtp", "entries": [{"protocol": "tcp", "port": 25}]}
    )
    before, events = _counts(), AuditEvent.objects.count()
    with pytest.raises(Problem) as refused:
        policy_apply(actor=CLI_ACTOR, data=data, expected_version=planned, source="p.yaml")
    assert refused.value.name == "precondition-failed" and "plan again" in refused.value.detail
    assert _counts() == before and AuditEvent.objects.count() == events
    assert not Service.objects.filter(name="ntp").exists()


BAD_FILE = """\
version: 1
services:
  - name: web
    id: 0b6a3f0e-0000-4000-8000-000000000000
    entries: [{protocol: tcp, port: 0}]
  - name: web
    entries: [{protocol: udp, port: 53}]
  - name: fine
    entries: [{protocol: udp, port: 123}]
address_groups:
  - {name: g, members: ["10.0.0.1/8"], colour: red}
rulesets:
  - name: a
    scope: "app in ("
  - name: b
    scope: app=db
    rules:
      - sources: [{address_group: nope}]
        services: [{service: pgsql}, {protocol: tcp}]
        unknown: 3
"""

BAD_FINDINGS = [
    "services[0].id: unknown-field",
    "services[0].entries[0].port: out-of-range",
    "services[1].name: duplicate-name",
    "address_groups[0].colour: unknown-field",
    "address_groups[0].members[0]: cidr-host-bits",
    "rulesets[0].scope: selector-syntax",
    "rulesets[1].rules[0].unknown: unknown-field",
    "rulesets[1].rules[0].services[1].port: port-required",
    "rulesets[1].rules[0].sources[0].address_group: unknown-reference",
    "rulesets[1].rules[0].services[0].service: unknown-reference",
]


def test_a_bad_file_gets_every_finding_with_its_path_and_nothing_is_written(db, tmp_path):
    from flows.policy_drafts.as_code.format import file_path

    data = policy_file_load(text=BAD_FILE, source="bad.yaml")
    for call in (
        lambda: policy_plan(data=data, prune=True),
        lambda: policy_apply(actor=CLI_ACTOR, data=data, expected_version=str(policy_version()), source="b"),
    ):
        with pytest.raises(PolicyFileInvalid) as invalid:
            call()
        assert [f"{file_path(f.path)}: {f.rule}" for f in invalid.value.findings] == BAD_FINDINGS
    assert _counts() == (0, 0, 0, 0)

    path = tmp_path / "bad.yaml"
    path.write_text(BAD_FILE)
    code, _, err = run("policy", "apply", str(path), "--expect-policy-version", str(policy_version()))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == len(BAD_FINDINGS)
    assert lines[-1] == (
        "error: rulesets[1].rules[0].services[0].service: no service named 'pgsql' in the file or stored. "
        "[unknown-reference]"
    )
    assert _counts() == (0, 0, 0, 0) and AuditEvent.objects.filter(action__startswith="service").count() == 0


@pytest.mark.parametrize(
    "text, message",
    [
        ("version: 1\nservices:\n  - name: a\n  name: b\n", "line 4 column 3"),
        ("version: 1\nservices: []\nservices: []\n", "line 3 column 1: the key 'services' is given twice"),
        ("version: 1\nx: &a [1]\ny: *a\n", "aliases"),
        ("version: 1\n1: 2\n", "a key must be a string"),
        ('version: 1\nservices: [{name: "a\\0b"}]\n', "NUL"),
    ],
)
def test_a_file_that_is_not_valid_yaml_is_one_line_naming_the_place(db, tmp_path, text, message):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    code, _, err = run("policy", "plan", str(path))
    assert code == 1 and len(err.strip().splitlines()) == 1 and message in err and "malformed-request" in err


def test_the_file_format_is_checked(db):
    for data, expected in [
        ([], [("", "type")]),
        ({**EMPTY, "version": "1"}, [("/version", "format-version")]),
        (
            {"version": 2, "services": [], "rulesets": {}},
            [("/version", "format-version"), ("/address_groups", "required"), ("/rulesets", "type")],
        ),
        ({**EMPTY, "services": None}, [("/services", "type")]),
        ({**EMPTY, "policy_version": "3"}, [("/policy_version", "unknown-field")]),
        (
            {
                **EMPTY,
                "rulesets": [
                    {
                        "name": "r",
                        "scope": "",
                        "version": "4",
                        "rules": [
                            {"id": "x", "sources": [{"any": True}], "services": [{"protocol": "icmp"}]}
                        ],
                    }
                ],
            },
            [
                ("/rulesets/0/version", "unknown-field"),
                ("/rulesets/0/rules/0/id", "unknown-field"),
                ("/rulesets/0/rules/0/id", "type"),
            ],
        ),
    ]:
        with pytest.raises(PolicyFileInvalid) as invalid:
            policy_plan(data=data)
        assert [(f.path, f.rule) for f in invalid.value.findings] == expected, data


def test_commands_export_plan_apply_and_their_exit_codes(fleet, tmp_path):
    _messy_policy()
    path = tmp_path / "policy.yaml"
    code, out, _ = run("policy", "export")
    assert code == 0 and out == policy_export(format="yaml")
    code, _, _ = run("policy", "export", "--format", "json", "-o", str(path.with_suffix(".json")))
    assert code == 0 and path.with_suffix(".json").read_text() == policy_export(format="json")
    code, _, _ = run("policy", "export", "-o", str(path))
    assert code == 0 and path.read_text() == out

    path.write_text(out.replace("scope: app=db", "scope: app=db,env=prod"))
    code, plan, _ = run("policy", "plan", str(path))
    version = str(policy_version())
    assert code == 0
    assert '~ change ruleset "zz-database"' in plan and '    scope: "app=db" -> "app=db,env=prod"' in plan
    assert "render dry-run: 0 workloads' documents change" in plan  # db-1 is in prod: it keeps its rules
    assert "impact over " in plan
    assert plan.strip().endswith(f"manage.py policy apply {path} --expect-policy-version {version}")

    code, _, err = run("policy", "apply", str(path), "--expect-policy-version", "1")
    assert code == 1 and err.count("\n") == 1 and "[precondition-failed]" in err
    code, out, _ = run("policy", "apply", str(path), "--expect-policy-version", version)
    assert code == 0 and out.startswith('~ change ruleset "zz-database"\n')
    assert (
        out.strip().splitlines()[-1]
        == f"applied 1 changes from {path}: policy version {version} -> {int(version) + 1}"
    )
    code, out, _ = run("policy", "plan", str(path))
    assert code == 0 and out.startswith("no changes")
    code, out, _ = run("policy", "plan", str(path), "--json")
    assert code == 0 and json.loads(out)["changes"] == []
    code, _, err = run("policy", "plan", str(tmp_path / "missing.yaml"))
    assert code == 1 and err.startswith("error: cannot read ") and err.count("\n") == 1
    with pytest.raises(CommandError, match="expect-policy-version"):
        run("policy", "apply", str(path))


def test_the_plans_lock_holds_even_when_the_policy_state_row_is_missing(db):
    """A database whose policy state row is gone (a flushed test database, a hand-made restore) must
    still serialise apply against edits: locking no row would let an edit commit under the plan."""
    PolicyState.objects.all().delete()
    with transaction.atomic():
        assert policy_version_lock() == PolicyState._meta.get_field("version").default
        assert PolicyState.objects.select_for_update().filter(id=1).exists()


@pytest.mark.postgres
def test_apply_racing_an_edit_applies_against_one_state(transactional_db):
    """Whichever commits first, apply either sees the edit's version and refuses, or holds the policy
    lock and the edit waits: never a plan applied to a policy that moved under it."""
    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    data = {**EMPTY, "services": [{"name": "ntp", "entries": [{"protocol": "udp", "port": 123}]}]}
    for attempt in range(5):
        version = str(policy_version())
        apply_result, edit_result = race(
            lambda: policy_apply(
                actor=CLI_ACTOR, data=data, prune=True, expected_version=version, source="p"
            ),
            lambda: writes.service_create(
                actor=CLI_ACTOR, data={"name": f"edit-{attempt}", "entries": [{"protocol": "tcp", "port": 1}]}
            ),
        )
        assert isinstance(edit_result, Service)
        names = set(Service.objects.values_list("name", flat=True))
        if isinstance(apply_result, Problem):
            assert apply_result.name == "precondition-failed"
            assert f"edit-{attempt}" in names
        else:
            # Applied first: the prune ran before the edit committed, so the edit survives it.
            assert names == {"ntp", f"edit-{attempt}"}


def test_names_and_texts_yaml_would_misread_round_trip(db):
    odd = [
        "yes",
        "null",
        "123",
        "0x1f",
        "a: b",
        "# not a comment",
        "- dash",
        "~",
        "'quoted'",
        'é"x',
        " padded ",
    ]
    for index, text in enumerate(odd):
        writes.service_create(
            actor=CLI_ACTOR,
            data={
                "name": text.strip() or f"s{index}",
                "description": text,
                "entries": [{"protocol": "icmp"}],
            },
        )
    writes.ruleset_create(
        actor=CLI_ACTOR,
        data={
            "name": "on",
            "description": 'two  spaces, é and "quotes"',
            "scope": "env in (prod, staging),!legacy",
            "rules": [{"sources": [{"any": True}], "services": [{"service": t.strip()} for t in odd]}],
        },
    )
    for format in ("yaml", "json"):
        text = policy_export(format=format)
        assert text.isascii()
        data = policy_file_load(text=text, source=f"policy.{format}")
        assert policy_plan(data=data, prune=True)["changes"] == []
        assert [s["name"] for s in data["services"]] == sorted(t.strip() for t in odd)


def test_a_deny_rule_round_trips_and_an_allow_rule_is_written_as_before(fleet):
    _messy_policy()
    before = policy_export(format="yaml")
    assert "action" not in before  # allow rules say nothing: old files keep their meaning and bytes
    data = policy_file_load(text=before, source="p.yaml")
    frontend = data["rulesets"][1]
    frontend["rules"][0]["action"] = "deny"
    frontend["rules"].append(
        {"action": "allow", "sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 9}]}
    )
    plan = policy_plan(data=data)
    fields = {f["field"]: f for f in plan["changes"][0]["fields"]}
    assert fields["rules[0].action"] == {
        "field": "rules[0].action",
        "action": "change",
        "old": "allow",
        "new": "deny",
    }
    policy_apply(actor=CLI_ACTOR, data=data, expected_version=plan["policy_version"], source="p.yaml")
    stored = Rule.objects.filter(ruleset__name="frontend").order_by("position")
    assert [r.action for r in stored] == ["deny", "allow", "allow", "allow"]
    exported = policy_file_load(text=policy_export(format="yaml"), source="p.yaml")
    assert [r.get("action") for r in exported["rulesets"][1]["rules"]] == ["deny", None, None, None]
    assert policy_plan(data=exported)["changes"] == []
    # a deny rule's documents carry its drop
    frontend_rule = stored[0]
    assert any(
        f'log prefix "palisade:in:{frontend_rule.number}"' in d
        for d in RenderedPolicy.objects.values_list("document", flat=True)
    )

    exported["rulesets"][1]["rules"][0]["action"] = "block"
    with pytest.raises(PolicyFileInvalid) as failed:
        policy_plan(data=exported)
    assert [(f.path, f.rule) for f in failed.value.findings] == [("/rulesets/1/rules/0/action", "action")]

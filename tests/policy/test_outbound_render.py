"""The output chain's "one rule, both ends" as the renderer writes it for a fleet: which inbound rules
meet a workload (found through indices, checked here against a plain walk), the destination sets an
inbound scope is written as, and the version of a document with an output chain."""

from __future__ import annotations

import hashlib
import ipaddress
import random
import re

from policy.classify import Connection, classify
from policy.grammar import parse_selector
from policy.render_inputs import (
    AddressGroupInput,
    FleetIndex,
    PortEntry,
    RuleInput,
    RulesetInput,
    SourceInput,
    WorkloadInput,
)
from policy.renderer import compile_policy, render

S = parse_selector
WEB = PortEntry("tcp", 8080)
ME = ("10.1.0.1", "fd01::1")  # the workload judging its outgoing connections


def inbound(name: str, scope: str, *rules: tuple[int, tuple[SourceInput, ...], str]) -> RulesetInput:
    return RulesetInput(
        name,
        name,
        S(scope),
        tuple(
            RuleInput(f"{name}-{number}", number, "", sources, (WEB,), number=number, action=action)
            for number, sources, action in rules
        ),
    )


def sel(text: str) -> SourceInput:
    return SourceInput("selector", S(text))


def fleet_with(*extra: WorkloadInput) -> list[WorkloadInput]:
    me = WorkloadInput("me", {"app": "client"}, ME, "visibility", "enforced")
    # Servers 10.2.0.0-10.2.0.15 in a row (a /28 of neighbours), databases scattered.
    servers = [WorkloadInput(f"web{i}", {"app": "web"}, (f"10.2.0.{i}",), "enforced") for i in range(16)]
    databases = [
        WorkloadInput(f"db{i}", {"app": "db"}, (f"10.3.{i}.{i * 7}",), "enforced") for i in range(1, 6)
    ]
    return [me, *servers, *databases, *extra]


RULESETS = [
    inbound("web", "app=web", (11, (sel("app=client"),), "allow")),
    inbound("db", "app=db", (21, (sel("app=client"),), "allow"), (22, (SourceInput("any"),), "deny")),
]


def test_a_scope_of_neighbours_is_written_as_prefixes_and_a_scattered_one_as_its_peer_set():
    workloads = fleet_with()
    fleet = FleetIndex.build(workloads)
    document = render(workloads[0], RULESETS, {}, fleet).document
    web = re.search(
        r"ip daddr @(\S+) meta l4proto \. th dport @\S+ ct mark set \S+ accept comment \"web", document
    )
    db = re.search(r"ip daddr @(\S+) meta l4proto \. th dport @\S+ ct mark set \S+ log prefix", document)
    assert web and db, document
    assert web[1].startswith("dst_") and db[1].startswith("sel_")
    assert re.search(rf"set {web[1]} {{[^}}]*elements = {{ 10\.2\.0\.0/28 }}", document)
    assert re.search(rf"set {db[1]} {{[^}}]*elements = {{ 10\.3\.1\.7, 10\.3\.2\.14,", document)
    # The classifier reads the scope's addresses: the same answers as the prefixes give.
    me = workloads[0]
    for peer, decision, rule in (
        ("10.2.0.9", "allowed", 11),
        ("10.2.0.16", "blocked", None),  # next to the prefix, no workload
        ("10.3.3.21", "blocked", 22),  # a database: its deny rule comes first
    ):
        outcome = classify(me, RULESETS, {}, fleet, Connection(peer, "tcp", 8080, direction="outbound"))
        assert (outcome.decision, outcome.rule) == (decision, rule), peer


def test_a_document_with_an_output_chain_is_versioned_by_its_parts_and_one_without_by_its_text():
    workloads = fleet_with()
    fleet = FleetIndex.build(workloads)
    result = render(workloads[0], RULESETS, {}, fleet)
    assert re.fullmatch(r"sha256:[0-9a-f]{32}", result.version)
    # The same document from a fresh index has the same version.
    assert render(workloads[0], RULESETS, {}, FleetIndex.build(workloads)).version == result.version
    # One more server (the prefix set changes) or one fewer database (the peer set changes): another.
    grown = fleet_with(WorkloadInput("web16", {"app": "web"}, ("10.2.0.16",), "enforced"))
    assert render(grown[0], RULESETS, {}, FleetIndex.build(grown)).version != result.version
    shrunk = workloads[:-1]
    assert render(shrunk[0], RULESETS, {}, FleetIndex.build(shrunk)).version != result.version
    # Without an output chain: the SHA-256 of the text, as always.
    server = workloads[1]
    plain = render(server, RULESETS, {}, fleet)
    assert "chain output" not in plain.document
    assert plain.version == "sha256:" + hashlib.sha256(plain.document.encode()).hexdigest()[:32]


def brute_force_families(policy, rulesets, groups, fleet, workload) -> list[tuple[int, tuple[int, ...]]]:
    """The inbound rules (chain order) with a line whose source holds the workload's address, by family:
    every rule's every line asked in turn."""
    own = [ipaddress.ip_address(a) for a in workload.addresses]
    found = []
    order = 0
    for ruleset in sorted((r for r in rulesets if r.direction == "inbound"), key=lambda r: (r.name, r.id)):
        compiled = next(c for c in policy._ordered if c.ruleset is ruleset)
        for _rule, rule_compiled in compiled.rules:
            families = set()
            for line in rule_compiled.lines:
                for address in own:
                    if line.source is None:
                        families.add(address.version)
                    elif line.family == address.version and policy.source_sets(
                        line.source, rule_compiled
                    ).contains(address.version, int(address)):
                        families.add(address.version)
            if families:
                found.append((order, tuple(sorted(families))))
            order += 1
    return found


def test_the_rules_meeting_a_workload_are_those_a_plain_walk_finds():
    rng = random.Random(34)
    apps = ("web", "db", "cache", "client")
    workloads = [
        WorkloadInput(
            f"w{i}",
            {"app": rng.choice(apps), "zone": rng.choice("ab")},
            (f"10.9.{i // 200}.{i % 200}",) + ((f"fd09::{i:x}",) if i % 3 == 0 else ()),
            "enforced",
            "simulation",
        )
        for i in range(300)
    ]
    groups = {
        "g1": AddressGroupInput("g1", "g1", ("10.9.0.0/26", "fd09::/120")),
        "g2": AddressGroupInput("g2", "g2", ("10.9.0.32/27", "10.9.1.0/24")),
        "g3": AddressGroupInput("g3", "g3", ("192.0.2.0/24",)),
    }

    def source() -> SourceInput:
        kind = rng.random()
        if kind < 0.5:
            return sel(
                f"app={rng.choice(apps)}" + (f",zone={rng.choice('ab')}" if rng.random() < 0.4 else "")
            )
        if kind < 0.85:
            return SourceInput("address_group", address_group_id=rng.choice(sorted(groups)))
        return SourceInput("any")

    rulesets = [
        inbound(
            f"rs{r}",
            rng.choice(("", "app=web", "zone=a", "app in (db,cache)")),
            *(
                (
                    r * 10 + k + 1,
                    tuple(source() for _ in range(rng.randint(1, 2))),
                    rng.choice(("allow", "deny")),
                )
                for k in range(4)
            ),
        )
        for r in range(12)
    ]
    fleet = FleetIndex.build(workloads)
    policy = compile_policy(rulesets, groups, fleet)
    for workload in workloads:
        assert policy._peer_families(workload) == brute_force_families(
            policy, rulesets, groups, fleet, workload
        )

"""policy.classify against the kernel for the connections a workload opens (root only).

As tests/dataplane/test_classifier_against_kernel.py does for inbound, with the workload's outbound
mode in simulation or enforced: random policies whose rulesets are made outbound at random (their
sources become destinations), the fleet's other workloads owning some of the peers' addresses under
inbound rulesets that name the workload's address or not ("one rule, both ends"), deny rules in
some seeds. The workload connects out from its own address to the peers' servers (tcp, udp, icmp and
icmpv6 echo) and to itself; every connection's conntrack entry in the workload's namespace is read
back and its mark decoded (direction flag included): it must be the classifier's decision and rule,
and an enforced drop's NFLOG prefix must name the classifier's deny rule, or none.
"""

from __future__ import annotations

import ipaddress
import json
import random
from dataclasses import replace

import pytest

from policy.classify import Connection, classify
from policy.grammar import parse_selector
from policy.render_inputs import FleetIndex, RulesetInput, SourceInput, WorkloadInput
from policy.renderer import decode_any_mark, render
from tests.dataplane.test_classifier_against_kernel import (
    _CLIENTS,
    _NFLOG_READER,
    _SERVERS,
    PEERS,
    PORTS,
    WORKLOAD,
    conntrack_marks,
    logged_rules,
    peer_addresses,
    random_policy,
)
from tests.support.netns import Lab, dataplane_call, require_namespace_lab

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def lab():
    require_namespace_lab()
    hosts = {"wl": WORKLOAD}
    for i, name in enumerate(PEERS, start=1):
        four, six = peer_addresses(i)
        hosts[name] = (four[0], six[0])
    with Lab.create(hosts, prefix_len=(16, 64)) as lab:
        servers = []
        try:
            for i, name in enumerate(PEERS, start=1):
                four, six = peer_addresses(i)
                for address in four[1:]:
                    lab.run(name, ["ip", "addr", "add", f"{address}/16", "dev", "eth0"], check=True)
                for address in six[1:]:
                    lab.run(name, ["ip", "addr", "add", f"{address}/64", "dev", "eth0", "nodad"], check=True)
                server = lab.popen_python(name, _SERVERS)
                servers.append(server)
                assert server.stdout.readline().strip() == "ready", server.stderr.read()
            local = lab.popen_python("wl", _SERVERS)  # for the workload's connections to itself
            servers.append(local)
            assert local.stdout.readline().strip() == "ready", local.stderr.read()
            yield lab
        finally:
            for server in servers:
                server.kill()
                server.wait(timeout=10)


def outbound_policy(rng: random.Random, mode: str, deny_share: float):
    workload, rulesets, groups, fleet = random_policy(rng, "visibility", deny_share)
    chooser = random.Random(rng.random())
    rulesets = [replace(r, direction="outbound") if chooser.random() < 0.5 else r for r in rulesets] + [
        # Inbound rulesets of the fleet's other workloads: their rules' sources may name the workload.
        RulesetInput(f"peer-{r.id}", f"peer {r.name}", scope, r.rules)
        for r, scope in zip(rulesets, [chooser.choice(SCOPES) for _ in rulesets], strict=True)
        if chooser.random() < 0.7
    ]
    # The peers' rulesets reuse the rules' lifetime numbers: renumber them past the originals.
    renumbered = []
    offset = 1000
    for ruleset in rulesets:
        if ruleset.id.startswith("peer-"):
            rules = tuple(
                replace(
                    rule,
                    id=f"{ruleset.id}-{rule.id}",
                    number=offset + k,
                    # Most name the workload, so that its connections meet them.
                    sources=rule.sources + ((NAMES_WORKLOAD,) if chooser.random() < 0.6 else ()),
                )
                for k, rule in enumerate(ruleset.rules)
            )
            offset += len(rules)
            ruleset = replace(ruleset, rules=rules)
        renumbered.append(ruleset)
    workload = WorkloadInput(workload.id, workload.labels, workload.addresses, "visibility", mode)
    return workload, renumbered, groups, fleet


SCOPES = tuple(parse_selector(s) for s in ("app=web", "app in (web,db)", "", "env=prod", "!tier"))
NAMES_WORKLOAD = SourceInput("selector", parse_selector("role=server"))


def outbound_connections(rng: random.Random, count: int) -> list[tuple[str, str, str, int]]:
    jobs = []
    for _ in range(count):
        four, six = peer_addresses(rng.randint(1, 3))
        family = rng.choice((4, 6))
        destination = rng.choice(four if family == 4 else six)
        protocol = rng.choice(("tcp", "tcp", "udp", "udp", "icmp" if family == 4 else "icmpv6"))
        jobs.append((protocol, WORKLOAD[0 if family == 4 else 1], destination, rng.choice(PORTS)))
    for protocol in ("tcp", "udp"):  # to itself: loopback, before any rule
        jobs.append((protocol, WORKLOAD[0], WORKLOAD[0], rng.choice(PORTS)))
    return jobs


@pytest.mark.parametrize(
    ("seed", "mode", "deny_share"),
    [
        (2, "simulation", 0.0),
        (3, "enforced", 0.0),
        (8, "enforced", 0.0),
        # Seeds whose connections meet deny rules: the workload's own and its destinations'.
        (7, "simulation", 0.35),
        (10, "enforced", 0.35),
        (15, "enforced", 0.35),
    ],
)
def test_the_classifier_names_the_rule_the_kernel_marks_outbound(lab, seed, mode, deny_share):
    judge_against_kernel(lab, seed, mode, deny_share)


@pytest.mark.parametrize(("seed", "mode", "deny_share"), [(2, "simulation", 0.0), (10, "enforced", 0.35)])
def test_destination_prefix_sets_decide_as_the_classifier_says(lab, seed, mode, deny_share):
    """Filler workloads own the addresses between the peers' ones, so that broad scopes collapse into
    prefixes (the output chain's `dst_` sets): the kernel still marks what the classifier says."""
    judge_against_kernel(lab, seed, mode, deny_share, filled=True)


FILLER_LABELS = {"app": "web", "env": "prod"}  # in every scope of SCOPES


def with_fillers(fleet: FleetIndex) -> FleetIndex:
    workloads = [
        WorkloadInput(
            workload_id,
            labels,
            tuple(str(ipaddress.ip_address(a)) for a in fleet.v4[p] + fleet.v6[p]),
            "visibility",
        )
        for p, (workload_id, labels) in enumerate(zip(fleet.workload_ids, fleet.labels, strict=True))
    ]
    for index in (1, 2, 3):
        # The rest of each peer's /28 (and its IPv6 /124): a peer's own addresses are 1, 2, 5, 9 (1, 2, 7).
        four, six = peer_addresses(index)
        addresses = [f"10.78.{index}.{i}" for i in range(16) if f"10.78.{index}.{i}" not in four]
        addresses += [f"fd78::{index}:{i:x}" for i in range(16) if f"fd78::{index}:{i:x}" not in six]
        workloads.append(WorkloadInput(f"filler-{index}", FILLER_LABELS, tuple(addresses), "visibility"))
    return FleetIndex.build(workloads)


def judge_against_kernel(lab, seed: int, mode: str, deny_share: float, filled: bool = False) -> None:
    rng = random.Random(seed)
    workload, rulesets, groups, fleet = outbound_policy(rng, mode, deny_share)
    if filled:
        fleet = with_fillers(fleet)
    document = render(workload, rulesets, groups, fleet).document
    assert "chain output" in document
    assert ("@dst_" in document) == filled
    assert dataplane_call(lab, "wl", "apply", document)["error"] is None
    lab.run("wl", ["conntrack", "-F"])
    jobs = outbound_connections(rng, 48)
    reader = lab.popen_python("wl", _NFLOG_READER)
    try:
        assert reader.stdout.readline().strip() == "ready", reader.stderr.read()
        done = lab.python("wl", _CLIENTS, input=json.dumps(jobs))
        assert done.returncode == 0, done.stderr
        answers = json.loads(done.stdout)
        logged = logged_rules(reader, "outbound")
    finally:
        reader.kill()
        reader.wait(timeout=10)
    marks = conntrack_marks(lab)

    rows, wrong, decisions, via_peer, denied = [], 0, set(), 0, 0
    peer_numbers = {rule.number for r in rulesets if r.id.startswith("peer-") for rule in r.rules}
    for index, ((protocol, source, destination, port), answer) in enumerate(zip(jobs, answers, strict=True)):
        outcome = classify(
            workload,
            rulesets,
            groups,
            fleet,
            Connection(
                destination,
                protocol,
                8 if protocol == "icmp" else 128 if protocol == "icmpv6" else port,
                loopback=destination == source,
                direction="outbound",
            ),
        )
        icmp = protocol in ("icmp", "icmpv6")
        # An enforced drop fails a raw socket's send (EPERM) before the client notes its echo id.
        echo_id = (index * 7919 + 17) & 0xFFFF  # as _CLIENTS makes it
        key = (protocol, source, echo_id if icmp else answer["key"], 0 if icmp else port)
        kernel: list = []
        for mark in marks.get(key, []):
            decoded = decode_any_mark(mark)
            kernel.append((None, None) if decoded is None else (decoded.decision, decoded.rule))
            assert decoded is None or decoded.direction == "outbound"
        want: list = [(outcome.decision, outcome.rule)]
        if outcome.decision == "blocked":
            kernel += [("blocked", rule) for rule in sorted(logged.get(key, ()), key=str)]
        ok = kernel == want and answer["answered"] == outcome.admitted
        wrong += not ok
        decisions.add(outcome.decision)
        via_peer += outcome.rule in peer_numbers and outcome.decision == "allowed"
        denied += outcome.rule is not None and outcome.decision != "allowed"
        rows.append(
            f"{'  ' if ok else '!!'} {protocol:6} -> {destination:>12}:{port}: kernel {kernel} "
            f"answered={answer['answered']}; classifier {want} admitted={outcome.admitted}"
        )
    assert not wrong, f"seed {seed} ({mode}):\n" + "\n".join(rows)
    refused = "blocked" if mode == "enforced" else "would_block"
    assert {"allowed", refused, None} <= decisions, "\n".join(rows)
    assert via_peer, "no connection was admitted by a destination's inbound rule:\n" + "\n".join(rows)
    assert bool(denied) == bool(deny_share), "\n".join(rows)

"""The classifier: which rule of a workload's rendered table admits a new inbound connection.

tests/dataplane/test_classifier_against_kernel.py checks the same function against the
kernel's ct marks; these pin the semantics case by case.
"""

from __future__ import annotations

import ipaddress

import pytest

from policy.classify import Connection, Outcome, PeerClasses, admitting_rule, classify
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
ANY = SourceInput("any")


def sel(text: str) -> SourceInput:
    return SourceInput("selector", S(text))


def grp(group_id: str) -> SourceInput:
    return SourceInput("address_group", address_group_id=group_id)


def rule(number, position, sources, entries, id=None) -> RuleInput:
    return RuleInput(id or f"r{number}", position, "", tuple(sources), tuple(entries), number=number)


WORKLOADS = [
    WorkloadInput("srv", {"role": "server"}, ("10.0.0.1", "2001:db8::1"), "visibility"),
    WorkloadInput("c1", {"role": "client"}, ("10.0.1.1", "2001:db8::11"), "visibility"),
    WorkloadInput("c2", {"role": "client", "env": "prod"}, ("10.0.1.2",), "visibility"),
    WorkloadInput("m1", {"role": "monitor"}, ("10.0.2.1",), "visibility"),
]
GROUPS = {
    "g-office": AddressGroupInput(
        "g-office", "office", ("192.168.10.0/24", "192.168.12.7", "2001:db8:1::/48")
    ),
    "g-empty": AddressGroupInput("g-empty", "empty", ()),
}
RULESETS = [
    # Listed out of order: the table orders rulesets by name, rules by position.
    RulesetInput(
        "rs-web",
        "web",
        S("role=server"),
        (
            rule(7, 20, [sel("role=monitor")], [PortEntry("tcp", 8080), PortEntry("icmp")]),
            rule(
                3,
                10,
                [sel("role=client"), grp("g-office")],
                [PortEntry("tcp", 8000, 8100), PortEntry("udp", 53)],
            ),
            rule(9, 30, [sel("env=prod")], [PortEntry("tcp", 8080)]),
        ),
    ),
    RulesetInput(
        "rs-base", "base", S("role"), (rule(12, 5, [ANY, sel("role=nobody")], [PortEntry("icmpv6")]),)
    ),
    RulesetInput("rs-db", "db", S("role=db"), (rule(20, 1, [ANY], [PortEntry("tcp", 5432)]),)),
    RulesetInput("rs-all", "z-all", S(""), (rule(30, 1, [grp("g-empty")], [PortEntry("tcp", 1, 65535)]),)),
]


def judge(peer, protocol, port=None, mode="enforced", rulesets=RULESETS, **connection) -> Outcome:
    workload = WorkloadInput("srv", {"role": "server"}, ("10.0.0.1", "2001:db8::1"), mode)
    fleet = FleetIndex.build(WORKLOADS)
    return classify(workload, rulesets, GROUPS, fleet, Connection(peer, protocol, port, **connection))


def rule_of(peer, protocol, port=None) -> int | None:
    outcome = judge(peer, protocol, port)
    return outcome.rule


@pytest.mark.parametrize(
    ("peer", "protocol", "port", "number"),
    [
        ("10.0.1.1", "tcp", 8000, 3),  # selector, range start
        ("10.0.1.1", "tcp", 8100, 3),  # range end
        ("10.0.1.1", "tcp", 8101, None),
        ("10.0.1.2", "tcp", 8080, 3),  # rule 3 (position 10) before rule 9 (position 30)
        ("10.0.1.1", "udp", 53, 3),
        ("10.0.1.1", "tcp", 53, None),  # udp entry, tcp connection
        ("2001:db8::11", "tcp", 8050, 3),  # the selector's IPv6 address
        ("192.168.10.200", "udp", 53, 3),  # group CIDR
        ("192.168.11.1", "udp", 53, None),
        ("192.168.12.7", "tcp", 8001, 3),  # group host
        ("2001:db8:1:ffff::9", "tcp", 8001, 3),  # group IPv6 CIDR
        ("10.0.2.1", "tcp", 8080, 7),
        ("10.0.2.1", "icmp", 8, 7),  # icmp echo from the monitor
        ("10.0.1.1", "icmp", 8, None),
        ("2001:db8:99::1", "icmpv6", 128, 12),  # "any" beats the selector beside it; base before web
        ("10.9.9.9", "icmp", 8, None),  # the icmpv6 rule is not an icmp rule
        ("10.9.9.9", "tcp", 5432, None),  # rs-db does not apply to a server
        ("10.9.9.9", "tcp", 1234, None),  # an empty group admits nothing
        ("10.0.0.1", "tcp", 8080, None),  # the workload itself is not a client
    ],
)
def test_first_matching_rule_in_table_order(peer, protocol, port, number):
    assert rule_of(peer, protocol, port) == number


def test_decisions_per_mode_are_what_the_mark_says():
    assert judge("10.0.1.1", "tcp", 8080, mode="enforced") == Outcome("allowed", 3)
    assert judge("10.0.1.1", "tcp", 8080, mode="simulation") == Outcome("allowed", 3)
    assert judge("10.0.1.1", "tcp", 8080, mode="visibility") == Outcome("observed")
    assert judge("10.9.9.9", "tcp", 22, mode="simulation") == Outcome("would_block")
    blocked = judge("10.9.9.9", "tcp", 22, mode="enforced")
    assert blocked == Outcome("blocked", admitted=False) and not blocked.admitted


@pytest.mark.parametrize("mode", ["visibility", "simulation", "enforced"])
def test_baseline_allowances_come_before_any_rule_and_set_no_mark(mode):
    def baseline(*args, **kwargs):
        outcome = judge(*args, mode=mode, **kwargs)
        assert (outcome.decision, outcome.rule) == (None, None)
        return outcome.baseline

    assert baseline("10.9.9.9", "tcp", 22, state="established") == "established"
    assert baseline("10.9.9.9", "icmp", 3, state="related") == "established"
    assert baseline("127.0.0.1", "tcp", 22, loopback=True) == "loopback"
    assert baseline("10.0.1.1", "tcp", 8080, loopback=True) == "loopback"  # before rule 3
    assert baseline("fe80::1", "icmpv6", 135) == "icmpv6-discovery"
    assert baseline("10.9.9.9", "udp", 68, source_port=67) == "dhcp"
    assert baseline("fe80::1", "udp", 546, source_port=547) == "dhcp"
    assert judge("2001:db8::5", "udp", 546, source_port=547, mode=mode).baseline is None  # not link-local
    assert judge("fe80::1", "icmpv6", 128, mode=mode).baseline is None  # echo is no discovery

    invalid = judge("10.9.9.9", "tcp", 22, state="invalid", mode=mode)
    assert (invalid.baseline, invalid.admitted) == ("invalid", mode != "enforced")


def test_selectors_resolve_to_the_fleet_now():
    workload = WorkloadInput("srv", {"role": "server"}, ("10.0.0.1",), "enforced")
    moved = [*WORKLOADS[:1], WorkloadInput("c1", {"role": "monitor"}, ("10.0.1.1",), "visibility")]
    connection = Connection("10.0.1.1", "tcp", 8080)
    assert classify(workload, RULESETS, GROUPS, FleetIndex.build(WORKLOADS), connection).rule == 3
    assert classify(workload, RULESETS, GROUPS, FleetIndex.build(moved), connection).rule == 7


def test_the_same_rule_numbers_the_rendered_table_marks():
    workload = WorkloadInput("srv", {"role": "server"}, ("10.0.0.1",), "enforced")
    fleet = FleetIndex.build(WORKLOADS)
    document = render(workload, RULESETS, GROUPS, fleet)
    seen = {
        admitting_rule(workload, RULESETS, GROUPS, fleet, Connection(peer, protocol, port))
        for peer in ("10.0.1.1", "10.0.2.1", "192.168.10.1", "2001:db8::11", "10.5.5.5")
        for protocol, port in (("tcp", 8080), ("udp", 53), ("icmp", 0), ("icmpv6", 128), ("tcp", 9))
    }
    assert seen - {None} == {3, 7, 12}
    assert seen - {None} <= set(document.rule_index)


def test_bad_connections_and_missing_groups_are_value_errors():
    for bad in (
        dict(peer="10.0.0.300", protocol="tcp", port=1),
        dict(peer="10.0.0.3", protocol="sctp", port=1),
        dict(peer="10.0.0.3", protocol="tcp", port=None),
        dict(peer="10.0.0.3", protocol="udp", port=70000),
        dict(peer="10.0.0.3", protocol="tcp", port=1, state="syn"),
    ):
        with pytest.raises(ValueError):
            Connection(**bad)
    with pytest.raises(ValueError, match="g-office"):
        classify(
            WorkloadInput("srv", {"role": "server"}, (), "enforced"),
            RULESETS,
            {},
            FleetIndex.build(WORKLOADS),
            Connection("10.9.9.9", "tcp", 8080),
        )


DENY_RULESETS = [
    *RULESETS,
    RulesetInput(
        "rs-deny",
        "zz-deny",
        S("role=server"),
        (
            RuleInput(
                "d41", 1, "", (sel("env=prod"),), (PortEntry("tcp", 8000, 8100),), number=41, action="deny"
            ),
            RuleInput("d42", 2, "", (ANY,), (PortEntry("tcp", 8050),), number=42, action="deny"),
        ),
    ),
]


@pytest.mark.parametrize(
    ("peer", "port", "mode", "outcome"),
    [
        # c2 (env=prod) is admitted by rule 3 today; deny 41 refuses it whatever the allow says
        ("10.0.1.2", 8080, "enforced", Outcome("blocked", 41, admitted=False)),
        ("10.0.1.2", 8080, "simulation", Outcome("would_block", 41)),
        ("10.0.1.2", 8080, "visibility", Outcome("observed")),
        # among deny rules, the first in ruleset and rule order names it
        ("10.0.1.2", 8050, "enforced", Outcome("blocked", 41, admitted=False)),
        ("10.0.1.1", 8050, "simulation", Outcome("would_block", 42)),
        # a deny rule that does not match leaves the allow in force
        ("10.0.1.1", 8080, "enforced", Outcome("allowed", 3)),
        # no rule at all: still no rule
        ("10.9.9.9", 22, "enforced", Outcome("blocked", admitted=False)),
    ],
)
def test_deny_rules_refuse_above_every_allow(peer, port, mode, outcome):
    assert judge(peer, "tcp", port, mode=mode, rulesets=DENY_RULESETS) == outcome


def test_denied_connections_have_no_admitting_rule():
    workload = WorkloadInput("srv", {"role": "server"}, ("10.0.0.1", "2001:db8::1"), "enforced")
    fleet = FleetIndex.build(WORKLOADS)
    assert admitting_rule(workload, DENY_RULESETS, GROUPS, fleet, Connection("10.0.1.2", "tcp", 8080)) is None
    assert admitting_rule(workload, DENY_RULESETS, GROUPS, fleet, Connection("10.0.1.1", "tcp", 8080)) == 3


def test_peers_of_one_class_are_judged_alike():
    """PeerClasses (what the flow-key classifier caches by): any two peers of one class get the same
    outcome for every connection, inbound and outbound, and peers that a rule tells apart are in
    different classes (a class blind to groups would put a group's member with an outsider)."""
    fleet = FleetIndex.build(WORKLOADS)
    classes = PeerClasses([compile_policy(RULESETS, GROUPS, fleet)])  # inbound
    outbound = PeerClasses([compile_policy(RULESETS, GROUPS, fleet)], "outbound")
    peers = [address for w in WORKLOADS for address in w.addresses] + [
        "192.168.10.0", "192.168.10.200", "192.168.10.255", "192.168.9.255", "192.168.11.0",
        "192.168.12.6", "192.168.12.7", "192.168.12.8", "2001:db8:1::", "2001:db8:1:ffff::9",
        "2001:db8:2::1", "2001:db8:99::1", "10.9.9.9", "10.0.1.3", "127.0.0.1", "::1", "fe80::1",
        "8.8.8.8",
    ]  # fmt: skip
    services = [("tcp", 8000), ("tcp", 8080), ("tcp", 8101), ("udp", 53), ("tcp", 5432), ("tcp", 1234),
                ("icmp", 8), ("icmpv6", 128), ("icmpv6", 135), ("udp", 546)]  # fmt: skip
    workload = WorkloadInput("c1", {"role": "client"}, ("10.0.1.1",), "simulation", "simulation")
    first_of: dict = {}
    for peer in peers:
        for direction, of in (("inbound", classes), ("outbound", outbound)):
            first_of.setdefault((direction, of.of(peer)), peer)
    assert classes.of("192.168.10.200") != classes.of("10.9.9.9")
    assert classes.of("10.0.1.1") != classes.of("10.0.1.3")
    assert classes.of("not an address") is None
    assert len([k for k in first_of if k[0] == "inbound"]) < len(peers)  # outsiders of a family share one
    for peer in peers:
        for direction, of in (("inbound", classes), ("outbound", outbound)):
            twin = first_of[(direction, of.of(peer))]
            for protocol, port in services:
                # As the flow-key classifier makes a key's connection: loopback from the peer.
                judged = [
                    classify(workload, RULESETS, GROUPS, fleet, Connection(
                        p, protocol, port, loopback=ipaddress.ip_address(p).is_loopback, direction=direction
                    ))
                    for p in (peer, twin)
                ]  # fmt: skip
                assert judged[0] == judged[1], (peer, twin, protocol, port, direction)

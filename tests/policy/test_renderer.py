"""The renderer as a pure function: policy objects in, one nftables document out."""

from __future__ import annotations

import ipaddress
import random
import re

import pytest

from policy.grammar import parse_selector
from policy.render_inputs import (
    AddressGroupInput,
    FleetIndex,
    FrozenLabels,
    PortEntry,
    RuleInput,
    RulesetInput,
    SourceInput,
    WorkloadInput,
)
from policy.renderer import (
    DECISION_ALLOWED,
    DECISION_BLOCKED,
    DECISION_OBSERVED,
    DECISION_WOULD_BLOCK,
    NFLOG_GROUP_BLOCKED,
    NFLOG_GROUP_WOULD_BLOCK,
    _group_sets,
    applicable_rulesets,
    decode_mark,
    encode_mark,
    render,
)

MODES = ("visibility", "simulation", "enforced")
S = parse_selector

# Lifetime rule numbers, as policy.services gives them: one per rule id, never reused.
_RULE_NUMBERS: dict[str, int] = {}


def numbered_rule(id, position, description, sources, entries, number=None) -> RuleInput:
    if number is None:
        number = _RULE_NUMBERS.setdefault(id, len(_RULE_NUMBERS) + 1)
    return RuleInput(id, position, description, sources, entries, number=number)


def sel(text: str) -> SourceInput:
    return SourceInput("selector", S(text))


def grp(group_id: str) -> SourceInput:
    return SourceInput("address_group", address_group_id=group_id)


ANY = SourceInput("any")
WEB = PortEntry("tcp", 8080)
DNS = PortEntry("udp", 5353)


def fleet_of(*workloads: WorkloadInput) -> FleetIndex:
    return FleetIndex.build(workloads)


def server(mode: str = "enforced", **labels: str) -> WorkloadInput:
    return WorkloadInput("srv", {"role": "server", **labels}, ("10.0.0.1",), mode)


def standard_policy():
    """Two applicable rulesets (out of order on purpose), one that does not apply, a group."""
    workloads = [
        server(),
        WorkloadInput("c1", {"role": "client"}, ("10.0.1.1", "2001:db8::11"), "visibility"),
        WorkloadInput("c2", {"role": "client", "env": "prod"}, ("10.0.1.2",), "visibility"),
        WorkloadInput("m1", {"role": "monitor"}, ("10.0.2.1",), "visibility"),
    ]
    rulesets = [
        RulesetInput(
            "rs-web",
            "web",
            S("role=server"),
            (
                numbered_rule(
                    "r-web-b", 20, "monitoring", (sel("role=monitor"),), (WEB, PortEntry("icmp")), number=7
                ),
                numbered_rule(
                    "r-web-a", 10, "clients", (sel("role=client"), grp("g-office")), (WEB, DNS), number=3
                ),
            ),
        ),
        RulesetInput(
            "rs-base",
            "base",
            S("role"),
            (
                numbered_rule(
                    "r-base", 5, "ping", (ANY,), (PortEntry("icmp"), PortEntry("icmpv6")), number=12
                ),
            ),
        ),
        RulesetInput(
            "rs-db", "db", S("role=db"), (numbered_rule("r-db", 1, "", (ANY,), (PortEntry("tcp", 5432),)),)
        ),
    ]
    groups = {"g-office": AddressGroupInput("g-office", "office", ("192.168.10.0/24", "2001:db8:1::/48"))}
    return workloads, rulesets, groups


def rendered(mode: str = "enforced"):
    workloads, rulesets, groups = standard_policy()
    return render(server(mode), rulesets, groups, FleetIndex.build(workloads))


def chain_lines(document: str) -> list[str]:
    chain = document[document.index("\tchain ") :]
    return [line.strip() for line in chain.splitlines()[2:] if line.strip() not in ("}", "")]


def drops(line: str) -> bool:
    return re.search(r"\bdrop\b", line.split(" comment ")[0]) is not None


def rule_lines(document: str) -> list[str]:
    return [line for line in chain_lines(document) if "ct mark set 0x02" in line]


# --- determinism -------------------------------------------------------------------------


def test_same_inputs_give_the_same_bytes_whatever_their_order():
    workloads, rulesets, groups = standard_policy()
    first = render(server(), rulesets, groups, FleetIndex.build(workloads))

    shuffled_rulesets = [
        RulesetInput(
            rs.id,
            rs.name,
            rs.scope,
            tuple(
                RuleInput(
                    r.id,
                    r.position,
                    r.description,
                    tuple(reversed(r.sources)),
                    tuple(reversed(r.entries)),
                    number=r.number,
                )
                for r in reversed(rs.rules)
            ),
        )
        for rs in reversed(rulesets)
    ]
    again = render(
        server(), shuffled_rulesets, dict(reversed(groups.items())), FleetIndex.build(reversed(workloads))
    )
    assert again.document == first.document
    assert again.rule_index == first.rule_index
    assert again.version == first.version


def test_cached_pieces_give_the_same_output_as_a_fresh_render():
    rng = random.Random(7)
    workloads = [
        WorkloadInput(
            f"w{i}",
            {"app": f"a{rng.randrange(6)}", "env": rng.choice(["prod", "dev"])},
            (f"10.1.{i // 250}.{i % 250 + 1}",) + ((f"2001:db8::{i:x}",) if i % 3 == 0 else ()),
            rng.choice(MODES),
        )
        for i in range(120)
    ]
    groups = {f"g{i}": AddressGroupInput(f"g{i}", f"group {i}", (f"172.16.{i}.0/24",)) for i in range(3)}
    rulesets = [
        RulesetInput(
            f"rs{i}",
            f"ruleset {i % 4}",  # equal names: the id breaks the tie
            S(f"app=a{i % 6}") if i % 2 else S("env=prod"),
            tuple(
                numbered_rule(
                    f"rs{i}-r{j}",
                    j,
                    f"rule {j}",
                    (sel(f"app=a{(i + j) % 6},env!=dev"), grp(f"g{j % 3}")) if j % 3 else (ANY,),
                    (PortEntry("tcp", 1000 + j, 1010 + j), PortEntry("udp", 53)),
                )
                for j in range(4)
            ),
        )
        for i in range(10)
    ]
    shared = FleetIndex.build(workloads)
    warm = [render(w, rulesets, groups, shared) for w in workloads]
    warm_again = [render(w, rulesets, groups, shared) for w in reversed(workloads)][::-1]
    cold = [render(w, rulesets, groups, FleetIndex.build(workloads)) for w in workloads]
    assert [r.document for r in warm] == [r.document for r in cold] == [r.document for r in warm_again]
    assert [r.rule_index for r in warm] == [r.rule_index for r in cold]


def test_a_changed_group_object_is_not_served_from_the_cache():
    workloads, rulesets, groups = standard_policy()
    fleet = FleetIndex.build(workloads)
    before = render(server(), rulesets, groups, fleet)
    changed = {"g-office": AddressGroupInput("g-office", "office", ("192.168.99.0/24",))}
    after = render(server(), rulesets, changed, fleet)
    assert "192.168.99.0/24" in after.document and "192.168.10.0/24" not in after.document
    assert after.version != before.version


def test_a_workload_with_labels_unlike_its_fleet_entry_uses_its_own_labels():
    workloads, rulesets, groups = standard_policy()
    fleet = FleetIndex.build(workloads)
    relabelled = WorkloadInput("srv", {"role": "db"}, ("10.0.0.1",), "enforced")  # e.g. a dry run
    result = render(relabelled, rulesets, groups, fleet)
    assert [entry["ruleset_name"] for entry in result.rule_index.values()] == ["base", "db"]


def test_version_is_a_content_hash():
    first, again = rendered(), rendered()
    assert re.fullmatch(r"sha256:[0-9a-f]{32}", first.version)
    assert first.version == again.version
    assert rendered("simulation").version != first.version


# --- modes ---------------------------------------------------------------------------------


def test_visibility_observes_everything_and_installs_no_rules():
    result = rendered("visibility")
    lines = chain_lines(result.document)
    assert "chain observe {" in result.document and result.document.count("\tchain ") == 1
    assert "type filter hook input priority filter; policy accept;" in result.document
    assert lines[-1].startswith(f"ct state new ct mark set {encode_mark(DECISION_OBSERVED):#010x} accept")
    assert result.rule_index == {}
    assert "\tset " not in result.document and "log " not in result.document
    assert not any(drops(line) for line in lines)


def test_simulation_records_and_accepts_what_no_rule_admits():
    lines = chain_lines(rendered("simulation").document)
    assert lines[-1].startswith(
        f"ct mark set {encode_mark(DECISION_WOULD_BLOCK):#010x} "
        f"log group {NFLOG_GROUP_WOULD_BLOCK} queue-threshold 1 accept"
    )
    assert not any(drops(line) for line in lines)


def test_enforced_logs_and_drops_what_no_rule_admits():
    lines = chain_lines(rendered("enforced").document)
    assert lines[-1].startswith(
        f"ct mark set {encode_mark(DECISION_BLOCKED):#010x} "
        f"log group {NFLOG_GROUP_BLOCKED} queue-threshold 1 drop"
    )
    assert any(line.startswith("ct state invalid drop") for line in lines)
    assert [line for line in lines if drops(line)] == [lines[1], lines[-1]]


def test_simulation_is_the_enforced_ruleset_with_another_end():
    simulation, enforced = rendered("simulation").document, rendered("enforced").document
    assert rule_lines(simulation) == rule_lines(enforced)
    assert len(chain_lines(simulation)) == len(chain_lines(enforced))
    # The same sets, too: only the table comment names the mode.
    assert simulation.split("\tchain ")[0].replace("simulation", "enforced") == enforced.split("\tchain ")[0]


@pytest.mark.parametrize("mode", MODES)
def test_baseline_allowances_come_first_in_every_mode(mode):
    lines = chain_lines(rendered(mode).document)
    baseline = [
        "ct state established,related accept",
        'iif "lo" accept',
        "icmpv6 type { nd-router-advert, nd-neighbor-solicit, nd-neighbor-advert, nd-redirect,",
        "udp sport 67 udp dport 68 accept",
        "ip6 saddr fe80::/10 udp sport 547 udp dport 546 accept",
    ]
    first_judgement = next(i for i, line in enumerate(lines) if "ct mark set" in line)
    for allowance in baseline:
        index = next(i for i, line in enumerate(lines) if line.startswith(allowance))
        assert index < first_judgement, allowance


def test_document_is_only_the_owned_table():
    for mode in MODES:
        document = rendered(mode).document
        assert document.startswith("table inet palisade {\n") and document.endswith("\n}\n")
        assert document.count("table ") == 1
        assert not re.search(r"^\s*(flush|add|delete|include)\b", document, re.MULTILINE)


# --- rules, numbering and the index ----------------------------------------------------------


def test_each_rule_is_marked_with_its_own_lifetime_number():
    result = rendered()
    assert result.rule_index == {
        12: {"ruleset_id": "rs-base", "ruleset_name": "base", "rule_id": "r-base", "position": 5},
        3: {"ruleset_id": "rs-web", "ruleset_name": "web", "rule_id": "r-web-a", "position": 10},
        7: {"ruleset_id": "rs-web", "ruleset_name": "web", "rule_id": "r-web-b", "position": 20},
    }
    # Evaluation order is still rulesets by name, then rules by position; only the marks are the rules' own.
    marks = [int(m, 16) for m in re.findall(r"ct mark set (0x02[0-9a-f]{6})", result.document)]
    assert list(dict.fromkeys(decode_mark(m)[1] for m in marks)) == [12, 3, 7]
    assert 'comment "web #10: clients"' in result.document


def test_a_rule_keeps_its_number_when_rules_are_added_or_removed_before_it():
    """A connection admitted under an earlier version names its rule by the mark it was given then:
    the same number must name the same rule in every version."""
    workloads, rulesets, groups = standard_policy()
    before = render(server(), rulesets, groups, FleetIndex.build(workloads))
    web = next(rs for rs in rulesets if rs.name == "web")
    earlier = numbered_rule("r-web-new", 1, "new first rule", (ANY,), (DNS,), number=13)
    grown = [
        RulesetInput(web.id, web.name, web.scope, (earlier, *web.rules)) if rs is web else rs
        for rs in rulesets
    ]
    after = render(server(), grown, groups, FleetIndex.build(workloads))
    assert after.version != before.version
    for number, entry in before.rule_index.items():
        assert after.rule_index[number]["rule_id"] == entry["rule_id"]
    assert after.rule_index[13]["rule_id"] == "r-web-new"
    shrunk = [RulesetInput(rs.id, rs.name, rs.scope, rs.rules[1:]) if rs is web else rs for rs in rulesets]
    without_first = render(server(), shrunk, groups, FleetIndex.build(workloads))
    for number, entry in without_first.rule_index.items():
        assert before.rule_index[number]["rule_id"] == entry["rule_id"]


def test_a_rule_without_a_lifetime_number_or_two_rules_with_one_are_errors():
    rulesets = [RulesetInput("rs", "web", S(""), (RuleInput("r", 1, "", (ANY,), (WEB,)),))]
    with pytest.raises(ValueError, match="no lifetime number"):
        render(server(), rulesets, {}, fleet_of(server()))
    twice = [
        RulesetInput("a", "a", S(""), (numbered_rule("x", 1, "", (ANY,), (WEB,), number=5),)),
        RulesetInput("b", "b", S(""), (numbered_rule("y", 1, "", (ANY,), (DNS,), number=5),)),
    ]
    with pytest.raises(ValueError, match="rule number 5"):
        render(server(), twice, {}, fleet_of(server()))


def test_applicable_rulesets_are_those_whose_scope_matches():
    _, rulesets, _ = standard_policy()
    assert [rs.name for rs in applicable_rulesets(server(), rulesets)] == ["base", "web"]
    assert applicable_rulesets(WorkloadInput("x", {}, (), "enforced"), rulesets) == []


def test_a_rule_becomes_sets_not_one_rule_per_peer():
    clients = [
        WorkloadInput(f"c{i}", {"role": "client"}, (f"10.2.{i // 200}.{i % 200 + 1}",), "visibility")
        for i in range(600)
    ]
    rulesets = [
        RulesetInput(
            "rs",
            "web",
            S("role=server"),
            (numbered_rule("r", 1, "", (sel("role=client"),), (WEB, DNS), number=1),),
        )
    ]
    result = render(server(), rulesets, {}, FleetIndex.build([server(), *clients]))
    lines = rule_lines(result.document)
    assert len(lines) == 1  # IPv4 only: the empty IPv6 set's rule is left out
    match = re.match(
        r"ip saddr @(\S+) meta l4proto \. th dport @(\S+) ct mark set 0x02000001 accept", lines[0]
    )
    assert match, lines[0]
    source_set, service_set = match.groups()
    body = result.document.split(f"set {source_set} {{")[1].split("}")[0]
    assert "flags interval" in body and "auto-merge" in body and "type ipv4_addr" in body
    assert sum(1 for _ in re.finditer(r"10\.2\.\d+\.\d+", body)) == 600
    service = result.document.split(f"set {service_set} {{")[1].split("}")[0]
    assert "type inet_proto . inet_service" in service and "tcp . 8080, udp . 5353" in service


def test_both_families_and_groups_get_their_own_sets():
    document = rendered().document
    lines = rule_lines(document)
    rule2 = [line for line in lines if "0x02000003" in line]  # r-web-a, number 3
    assert len(rule2) == 4  # (role=client, office) x (IPv4, IPv6)
    assert sum(line.startswith("ip saddr @sel_") for line in rule2) == 1
    assert sum(line.startswith("ip6 saddr @sel_") for line in rule2) == 1
    assert sum(line.startswith("ip saddr @grp_") for line in rule2) == 1
    assert sum(line.startswith("ip6 saddr @grp_") for line in rule2) == 1
    assert "2001:db8::11" in document and "2001:db8:1::/48" in document and "192.168.10.0/24" in document


def test_icmp_entries_match_the_protocol():
    lines = rule_lines(rendered().document)
    assert [line for line in lines if "0x0200000c" in line] == [  # r-base, number 12
        'meta l4proto icmp ct mark set 0x0200000c accept comment "base #5: ping"',
        'meta l4proto ipv6-icmp ct mark set 0x0200000c accept comment "base #5: ping"',
    ]
    rule3 = [line for line in lines if "0x02000007" in line]  # r-web-b, number 7
    assert any(re.match(r"ip saddr @sel_\S+ meta l4proto icmp ct mark", line) for line in rule3)
    assert not any("ipv6-icmp" in line for line in rule3)


def test_any_source_matches_every_address_and_makes_other_sources_moot():
    rulesets = [
        RulesetInput(
            "rs", "open", S(""), (numbered_rule("r", 1, "", (sel("role=client"), ANY), (WEB,), number=1),)
        ),
    ]
    result = render(server(), rulesets, {}, fleet_of(server()))
    lines = rule_lines(result.document)
    assert len(lines) == 1
    assert lines[0].startswith("meta l4proto . th dport @svc_")
    assert "saddr" not in lines[0] and "set sel_" not in result.document


def test_a_selector_matching_no_workload_admits_nothing():
    rulesets = [
        RulesetInput(
            "rs", "web", S(""), (numbered_rule("r", 1, "", (sel("role=nobody"),), (WEB,), number=1),)
        )
    ]
    result = render(server("simulation"), rulesets, {}, fleet_of(server()))
    lines = rule_lines(result.document)
    # The rule stays visible, over empty sets, and admits nothing.
    assert (
        len(lines) == 2 and lines[0].startswith("ip saddr @sel_") and lines[1].startswith("ip6 saddr @sel_")
    )
    for name in re.findall(r"saddr @(\S+)", "\n".join(lines)):
        body = result.document.split(f"set {name} {{")[1].split("}")[0]
        assert "elements" not in body
    assert result.rule_index[1]["rule_id"] == "r"


def test_overlapping_port_ranges_merge():
    entries = (
        PortEntry("tcp", 8000, 8100),
        PortEntry("tcp", 8050, 8200),
        PortEntry("tcp", 8201),
        PortEntry("udp", 53),
    )
    rulesets = [RulesetInput("rs", "ports", S(""), (numbered_rule("r", 1, "", (ANY,), entries),))]
    document = render(server(), rulesets, {}, fleet_of(server())).document
    assert "elements = { tcp . 8000-8201, udp . 53 }" in document


def test_group_members_overlapping_collapse():
    groups = {"g": AddressGroupInput("g", "g", ("10.9.0.0/16", "10.9.1.0/24", "10.9.2.7/32"))}
    rulesets = [RulesetInput("rs", "grp", S(""), (numbered_rule("r", 1, "", (grp("g"),), (WEB,), number=1),))]
    document = render(server(), rulesets, groups, fleet_of(server())).document
    assert "elements = { 10.9.0.0/16 }" in document


def test_a_group_s_sets_hold_its_members_collapsed_as_ipaddress_collapses_them():
    """The group's sets are cut into prefixes from integer spans (thousands of hosts for a suggested
    draft): the same prefixes, in the same order, as ipaddress.collapse_addresses, and the intervals
    that policy.classify reads are theirs."""
    rng = random.Random(32)
    for _ in range(300):
        members = []
        for family, bits in ((4, 32), (6, 128)):
            base = rng.randrange(1 << (bits - 1))
            for _ in range(rng.randrange(12)):
                length = rng.choice((bits, bits, rng.randint(bits - 6, bits)))
                value = (base + rng.randrange(200)) >> (bits - length) << (bits - length)
                network = (
                    ipaddress.ip_network((value, length))
                    if family == 4
                    else ipaddress.IPv6Network((value, length))
                )
                members.append(str(network.network_address) if length == bits else str(network))
        found = _group_sets(AddressGroupInput("g", "g", tuple(members)), fleet_of(server()))
        for family in (4, 6):
            expected = list(
                ipaddress.collapse_addresses(
                    n for n in map(ipaddress.ip_network, members) if n.version == family
                )
            )
            assert found.intervals[family] == tuple(
                (int(n.network_address), int(n.broadcast_address)) for n in expected
            ), members
            texts = [str(n.network_address) if n.prefixlen == n.max_prefixlen else str(n) for n in expected]
            definition = found.sets[family][1]
            if texts:
                elements = definition.split("elements = { ", 1)[1].split(" }", 1)[0]
                assert re.split(r",\s*", elements) == texts, members
            else:
                assert "elements" not in definition
            assert found.has[family] == bool(expected)


def test_comments_are_safe_for_nftables():
    rulesets = [
        RulesetInput("rs", 'we"ird\nname', S(""), (numbered_rule("r", 1, "é" * 200, (ANY,), (WEB,)),))
    ]
    document = render(server(), rulesets, {}, fleet_of(server())).document
    for comment in re.findall(r'comment "([^"\n]*)"', document):
        assert len(comment.encode()) <= 128
    assert "we ird name #1: éé" in document


def test_a_missing_group_is_an_error():
    rulesets = [
        RulesetInput("rs", "grp", S(""), (numbered_rule("r", 1, "", (grp("gone"),), (WEB,), number=1),))
    ]
    with pytest.raises(ValueError, match="gone"):
        render(server(), rulesets, {}, fleet_of(server()))


@pytest.mark.parametrize("member", ["10.99.0.300", "example.com", "10.0.0.0/33", "fe80::1%eth0"])
def test_a_bad_group_member_raises_instead_of_reaching_nftables(member):
    groups = {"g": AddressGroupInput("g", "g", ("10.0.0.0/24", member))}
    rulesets = [RulesetInput("rs", "grp", S(""), (numbered_rule("r", 1, "", (grp("g"),), (WEB,), number=1),))]
    with pytest.raises(ValueError):
        render(server(), rulesets, groups, fleet_of(server()))


@pytest.mark.parametrize("address", ["10.99.0.300", "db.example.com", "10.0.0.0/24", "fe80::1%eth0", ""])
def test_a_bad_workload_address_raises(address):
    with pytest.raises(ValueError):
        FleetIndex.build([WorkloadInput("w", {}, (address,), "enforced")])


def test_input_shapes_are_checked():
    with pytest.raises(ValueError):
        PortEntry("tcp")
    with pytest.raises(ValueError):
        PortEntry("icmp", 1)
    with pytest.raises(ValueError):
        PortEntry("tcp", 90, 80)
    with pytest.raises(ValueError):
        PortEntry("sctp", 1)
    with pytest.raises(ValueError):
        SourceInput("selector")
    with pytest.raises(ValueError):
        SourceInput("address_group", selector=S("a=b"))
    with pytest.raises(ValueError):
        WorkloadInput("w", {}, (), "audit")
    assert PortEntry("tcp", 80) == PortEntry("tcp", 80, 80)
    assert hash(WorkloadInput("w", {"a": "1"}, ["10.0.0.1"], "enforced")) == hash(
        WorkloadInput("w", FrozenLabels([("a", "1")]), ("10.0.0.1",), "enforced")
    )


# --- marks ------------------------------------------------------------------------------------


def test_marks_encode_and_decode():
    assert decode_mark(encode_mark(DECISION_ALLOWED, 42)) == ("allowed", 42)
    assert decode_mark(0x02000001) == ("allowed", 1)
    assert decode_mark(0x01000000) == ("observed", None)
    assert decode_mark(0x03000000) == ("would_block", None)
    assert decode_mark(0x04000000) == ("blocked", None)
    assert decode_mark(0) == (None, None)
    assert decode_mark(0x7F000001) == (None, None)
    with pytest.raises(ValueError):
        encode_mark(DECISION_ALLOWED, 1 << 24)


# --- the fleet index ----------------------------------------------------------------------------


def test_fleet_index_agrees_with_selector_matches():
    rng = random.Random(11)
    keys, values = ["app", "env", "tier", "zone"], ["a", "b", "c", "d", "e"]
    workloads = [
        WorkloadInput(
            f"w{i}",
            {k: rng.choice(values) for k in keys if rng.random() < 0.8},
            (f"10.3.{i // 250}.{i % 250}",) + ((f"2001:db8:3::{i + 1:x}",) if i % 4 == 0 else ()),
            "visibility",
        )
        for i in range(400)
    ]
    fleet = FleetIndex.build(workloads)
    ops = ["{k}={v}", "{k}!={v}", "{k} in ({v},{w})", "{k} notin ({v},{w})", "{k}", "!{k}", "{k}="]
    for _ in range(300):
        parts = [
            rng.choice(ops).format(k=rng.choice(keys), v=rng.choice(values), w=rng.choice(values))
            for _ in range(rng.randrange(0, 4))
        ]
        selector = S(",".join(parts))
        expected = {i for i, w in enumerate(workloads) if selector.matches(w.labels)}
        assert fleet.positions_matching(selector) == expected, str(selector)
        four, six = fleet.addresses_matching(selector)
        assert four == {a for i in expected for a in workloads[i].addresses if ":" not in a}
        assert six == {a for i in expected for a in workloads[i].addresses if ":" in a}


# --- deny rules ----------------------------------------------------------------------------


def deny_policy():
    """The standard policy plus a ruleset (named after the others) whose deny rule refuses client c1."""
    workloads, rulesets, groups = standard_policy()
    deny = RuleInput(
        "r-deny", 1, "no c1 on web", (SourceInput("selector", S("env notin (prod),role=client")),), (WEB,)
    )
    deny = RuleInput(deny.id, deny.position, deny.description, deny.sources, deny.entries, 40, "deny")
    rulesets = [*rulesets, RulesetInput("rs-zz", "zz-deny", S("role=server"), (deny,))]
    return workloads, rulesets, groups


def test_deny_rules_come_after_the_baseline_and_before_every_allow():
    workloads, rulesets, groups = deny_policy()
    lines = chain_lines(render(server("enforced"), rulesets, groups, FleetIndex.build(workloads)).document)
    deny_at = [i for i, line in enumerate(lines) if "0x04000028" in line]
    allow_at = [i for i, line in enumerate(lines) if "ct mark set 0x02" in line]
    baseline_at = [i for i, line in enumerate(lines) if "baseline" in line]
    # the ruleset sorts last by name, yet its deny lines precede every ruleset's allow lines
    assert deny_at and allow_at and max(baseline_at) < min(deny_at) and max(deny_at) < min(allow_at)
    for i in deny_at:
        assert drops(lines[i]) and 'log prefix "palisade:in:40" group 7302' in lines[i]


def test_simulation_accepts_and_marks_what_a_deny_rule_matches_as_would_block():
    workloads, rulesets, groups = deny_policy()
    result = render(server("simulation"), rulesets, groups, FleetIndex.build(workloads))
    lines = [line for line in chain_lines(result.document) if "0x03000028" in line]
    assert lines and not any(drops(line) for line in lines)
    assert all(line.split(" comment ")[0].endswith("accept") for line in lines)
    assert result.rule_index[40]["action"] == "deny" and "action" not in result.rule_index[3]


def test_a_policy_without_deny_rules_renders_as_before():
    # An allow rule stated as such is the rule without an action: the same bytes.
    workloads, rulesets, groups = standard_policy()
    explicit = [
        RulesetInput(
            rs.id,
            rs.name,
            rs.scope,
            tuple(
                RuleInput(r.id, r.position, r.description, r.sources, r.entries, r.number, "allow")
                for r in rs.rules
            ),
        )
        for rs in rulesets
    ]
    for mode in ("simulation", "enforced"):
        fleet = FleetIndex.build(workloads)
        before = render(server(mode), rulesets, groups, fleet)
        after = render(server(mode), explicit, groups, FleetIndex.build(workloads))
        assert before.document == after.document and before.rule_index == after.rule_index
        assert "log prefix" not in before.document


def test_an_unknown_action_is_refused():
    with pytest.raises(ValueError, match="action"):
        RuleInput("r", 1, "", (ANY,), (WEB,), 1, "reject")

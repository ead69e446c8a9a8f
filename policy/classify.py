"""Which rule of a workload's table admits a connection: the renderer's semantics as a function.

``classify`` answers for one inbound connection what the table ``render`` produces for the
same inputs would do with its first packet, and with which ct mark:

* the baseline allowances, checked in the table's order before any rule: ``established``
  (and ``related``: replies and ICMP errors about admitted connections), ``invalid``
  (accepted unmarked in simulation, dropped unmarked in enforced), ``loopback``,
  ``icmpv6-discovery`` (neighbour/router discovery, multicast listeners), ``dhcp``. These set
  no mark: the outcome carries the allowance's name and neither decision nor rule;
* in ``visibility`` every other connection is ``observed``;
* otherwise the first deny rule with a line that matches, as the chain lists every deny rule
  of every applicable ruleset before the first allow: ``would_block`` (simulation) or ``blocked``
  (enforced) with the deny rule's lifetime number;
* otherwise the first allow rule with a line that matches (rulesets by name then id, rules by
  position then id, as the chain lists them): ``allowed`` with the rule's lifetime number,
  which is what ``decode_mark`` reads from the conntrack entry; no rule: ``would_block`` in
  simulation, ``blocked`` in enforced, with no rule.

It walks the renderer's own compiled policy (``compile_policy``: the rulesets that apply, their
rules' lines, their sources' sets, compiled once per fleet as for a render), so the two cannot
disagree about order, selectors resolved to the fleet's addresses now, address groups, services,
ranges, ICMP and ``any``. Pure: no Django, no I/O.

A line the renderer leaves out (a source with addresses of the other family only) would
match nothing here either: its set is empty.

Outbound (``Connection.direction == "outbound"``: the workload opens the connection, ``peer`` is the
destination, ``port`` the destination's port) walks the output chain the same way, under the
workload's ``outbound_mode``: in ``visibility`` no chain judges it (``decision`` None, baseline
``unjudged``: the ct mark stays 0); otherwise the baseline (``established``, ``invalid``,
``loopback``, ``icmpv6-discovery``, ``dhcp``, ``gateway``: one of the ``gateways`` the agent adds),
the fail-safe list (``allowed``, ``failsafe=True``, no rule), the workload's outbound deny then allow
rules, its destinations' inbound deny then allow rules that name its address (``CompiledPolicy.peer_lines``),
then ``would_block``/``blocked``.
"""

from __future__ import annotations

import bisect
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from policy.render_inputs import (
    PORT_PROTOCOLS,
    PROTOCOLS,
    AddressGroupInput,
    FleetIndex,
    PortEntry,
    RulesetInput,
    WorkloadInput,
    parse_host_address,
)
from policy.renderer import (
    DECISION_ALLOWED,
    DECISION_BLOCKED,
    DECISION_NAMES,
    DECISION_OBSERVED,
    DECISION_WOULD_BLOCK,
    DEFAULT_OUTBOUND_FAILSAFE,
    CompiledPolicy,
    CompiledRule,
    CompiledRuleset,
    Line,
    SourceSets,
    compile_policy,
)

STATES = ("new", "established", "related", "invalid")
# The ICMPv6 types of the baseline's discovery line (nd-router-advert ... mld2-listener-report).
ICMPV6_DISCOVERY_TYPES = frozenset({134, 135, 136, 137, 130, 131, 132, 143})
# The output baseline's discovery line (nd-router-solicit ... mld2-listener-report).
ICMPV6_OUT_DISCOVERY_TYPES = frozenset({133, 135, 136, 131, 132, 143})
_LINK_LOCAL_V6 = ipaddress.ip_network("fe80::/10")


@dataclass(frozen=True)
class Connection:
    """The first packet of an inbound connection, as the input hook sees it."""

    peer: str  # the source address; its family picks IPv4 or IPv6
    protocol: str  # tcp, udp, icmp, icmpv6
    port: int | None = None  # tcp/udp destination port; icmp/icmpv6 type (None: not a discovery type)
    state: str = "new"  # the conntrack state of the packet
    loopback: bool = False  # arrived on "lo"
    source_port: int | None = None  # tcp/udp; only the DHCP allowances read it
    # outbound: the workload opened it; `peer` is the destination, `port` the destination's port.
    direction: str = "inbound"

    def __post_init__(self) -> None:
        if self.direction not in ("inbound", "outbound"):
            raise ValueError(f"unknown direction {self.direction!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {self.protocol!r}")
        if self.state not in STATES:
            raise ValueError(f"unknown connection state {self.state!r}")
        if self.protocol in PORT_PROTOCOLS and (type(self.port) is not int or not 0 <= self.port <= 65535):
            raise ValueError(f"{self.protocol} needs a destination port in 0-65535, not {self.port!r}")
        parse_host_address(self.peer)  # raises ValueError


@dataclass(frozen=True)
class Outcome:
    """What the table does: ``decision``/``rule`` as ``decode_mark`` reads the ct mark, or the
    baseline allowance that accepted the packet without a mark."""

    decision: str | None  # observed, allowed, would_block, blocked; None under a baseline allowance
    rule: int | None = None  # the admitting rule's lifetime number ("allowed"), or the refusing deny rule's
    baseline: str | None = None  # established, invalid, loopback, icmpv6-discovery, dhcp
    admitted: bool = True  # the packet gets through (False: enforced drops it)
    failsafe: bool = False  # outbound: admitted by the fail-safe list (the mark's FAILSAFE_FLAG)


def _baseline(connection: Connection, family: int, address: int) -> str | None:
    """The baseline allowance (in the table's order) that accepts the packet, if any."""
    if connection.state in ("established", "related"):
        return "established"
    if connection.state == "invalid":
        return "invalid"
    if connection.loopback:
        return "loopback"
    if connection.protocol == "icmpv6" and connection.port in ICMPV6_DISCOVERY_TYPES:
        return "icmpv6-discovery"
    if connection.protocol == "udp":
        if connection.source_port == 67 and connection.port == 68:
            return "dhcp"
        if (
            family == 6
            and connection.source_port == 547
            and connection.port == 546
            and address in _LINK_LOCAL_RANGE
        ):
            return "dhcp"
    return None


_LINK_LOCAL_RANGE = range(int(_LINK_LOCAL_V6.network_address), int(_LINK_LOCAL_V6.broadcast_address) + 1)


def classify(
    workload: WorkloadInput,
    rulesets: Sequence[RulesetInput],
    groups: Mapping[str, AddressGroupInput],
    fleet: FleetIndex,
    connection: Connection,
    *,
    failsafe: Sequence[PortEntry] = DEFAULT_OUTBOUND_FAILSAFE,
    gateways: Iterable[tuple[str, int]] = (),
) -> Outcome:
    """How ``render(workload, rulesets, groups, fleet)``'s table judges ``connection`` (with the
    `gateways` (address, tcp port) the agent adds to it)."""
    if connection.direction == "outbound":
        return _classify_outbound(
            workload, compile_policy(rulesets, groups, fleet, failsafe), connection, gateways
        )
    peer = parse_host_address(connection.peer)
    family, address = peer.version, int(peer)
    baseline = _baseline(connection, family, address)
    if baseline is not None:
        # Enforced drops invalid packets, unmarked and unlogged; the other modes accept them
        # unmarked (visibility has no invalid line: they are not "new", so never observed).
        return Outcome(
            None, None, baseline, admitted=not (baseline == "invalid" and workload.mode == "enforced")
        )
    if workload.mode == "visibility":
        return Outcome(DECISION_NAMES[DECISION_OBSERVED])
    policy = compile_policy(rulesets, groups, fleet)
    denied = _first_rule(workload, policy, connection, family, address, action="deny")
    rule = None if denied is not None else _first_rule(workload, policy, connection, family, address)
    if rule is not None:
        return Outcome(DECISION_NAMES[DECISION_ALLOWED], rule)
    if workload.mode == "enforced":
        return Outcome(DECISION_NAMES[DECISION_BLOCKED], denied, admitted=False)
    return Outcome(DECISION_NAMES[DECISION_WOULD_BLOCK], denied)


def _outbound_baseline(connection: Connection, gateways: Iterable[tuple[str, int]]) -> str | None:
    if connection.state in ("established", "related"):
        return "established"
    if connection.state == "invalid":
        return "invalid"
    if connection.loopback:
        return "loopback"
    if connection.protocol == "icmpv6" and connection.port in ICMPV6_OUT_DISCOVERY_TYPES:
        return "icmpv6-discovery"
    if connection.protocol == "udp" and (connection.source_port, connection.port) in ((68, 67), (546, 547)):
        return "dhcp"
    if connection.protocol == "tcp":
        peer = parse_host_address(connection.peer)
        if any(parse_host_address(a) == peer and p == connection.port for a, p in gateways):
            return "gateway"
    return None


def _classify_outbound(
    workload: WorkloadInput,
    policy: CompiledPolicy,
    connection: Connection,
    gateways: Iterable[tuple[str, int]],
) -> Outcome:
    if workload.outbound_mode == "visibility":
        return Outcome(None, None, "unjudged")
    baseline = _outbound_baseline(connection, gateways)
    if baseline is not None:
        return Outcome(None, None, baseline)
    peer = parse_host_address(connection.peer)
    family, address = peer.version, int(peer)
    protocol, port = connection.protocol, connection.port
    if protocol in PORT_PROTOCOLS and any(
        p == protocol and low <= port <= high  # type: ignore[operator]  # tcp/udp have one
        for p, low, high in policy.failsafe_ranges
    ):
        return Outcome(DECISION_NAMES[DECISION_ALLOWED], None, failsafe=True)
    enforced = workload.outbound_mode == "enforced"
    refused = DECISION_NAMES[DECISION_BLOCKED if enforced else DECISION_WOULD_BLOCK]
    own = policy.applicable_outbound(workload)
    denied = _first_rule(workload, policy, connection, family, address, action="deny", rulesets=own)
    if denied is not None:
        return Outcome(refused, denied, admitted=not enforced)
    allowed = _first_rule(workload, policy, connection, family, address, rulesets=own)
    if allowed is not None:
        return Outcome(DECISION_NAMES[DECISION_ALLOWED], allowed)
    peer_denies, peer_allows = policy.peer_lines(workload)
    for peers, refusing in ((peer_denies, True), (peer_allows, False)):
        for line in peers:
            if line.family != family or not _service_matches(line.compiled, line.line, protocol, port):
                continue
            if not policy.selector_sets(line.scope).contains(family, address):
                continue
            if refusing:
                return Outcome(refused, line.rule.number, admitted=not enforced)
            return Outcome(DECISION_NAMES[DECISION_ALLOWED], line.rule.number)
    return Outcome(refused, None, admitted=not enforced)


def _service_matches(compiled: CompiledRule, line: Line, protocol: str, port: int | None) -> bool:
    if line.uses_service_set:
        return protocol in PORT_PROTOCOLS and any(
            p == protocol and low <= port <= high  # type: ignore[operator]  # tcp/udp have one
            for p, low, high in compiled.service_ranges
        )
    return line.l4proto == protocol


def admitting_rule(
    workload: WorkloadInput,
    rulesets: Sequence[RulesetInput],
    groups: Mapping[str, AddressGroupInput],
    fleet: FleetIndex,
    connection: Connection,
) -> int | None:
    """The lifetime number of the first rule that admits a new ``connection``, or None (also when a
    deny rule refuses it).

    Rules only: the baseline and the workload's mode are ``classify``'s business.
    """
    peer = parse_host_address(connection.peer)
    policy = compile_policy(rulesets, groups, fleet)
    if _first_rule(workload, policy, connection, peer.version, int(peer), action="deny") is not None:
        return None
    return _first_rule(workload, policy, connection, peer.version, int(peer))


def _first_rule(
    workload: WorkloadInput,
    policy: CompiledPolicy,
    connection: Connection,
    family: int,
    address: int,
    action: str = "allow",
    rulesets: Sequence[CompiledRuleset] | None = None,
) -> int | None:
    """The first rule of `action` (in chain order) with a line matching the connection: of the
    workload's inbound rulesets, or of `rulesets`."""
    protocol, port = connection.protocol, connection.port
    ported = protocol in PORT_PROTOCOLS
    for ruleset in policy.applicable(workload) if rulesets is None else rulesets:
        for rule, compiled in ruleset.rules:
            if rule.action != action:
                continue
            # "meta l4proto . th dport @svc_...": the same set on each of the rule's lines.
            in_service_set = ported and any(
                p == protocol and low <= port <= high  # type: ignore[operator]  # tcp/udp have one
                for p, low, high in compiled.service_ranges
            )
            for line in compiled.lines:
                if line.uses_service_set:
                    if not in_service_set:
                        continue
                elif line.l4proto != protocol:
                    continue
                if line.source is not None:
                    # "ip saddr @..." / "ip6 saddr @...": only packets of the line's family.
                    if family != line.family:
                        continue
                    if not policy.source_sets(line.source, compiled).contains(family, address):
                        continue
                return rule.number
    return None


class PeerClasses:
    """Peers that every one of `policies` judges alike in connections of `direction`: of one family, alike in what the baseline reads
    of an address (loopback, IPv6 link-local), and held by the same of the sets any rule or scope of
    those policies tests a peer against (`CompiledPolicy.every_source_set`). That is all of a peer that
    `classify` reads, so a connection of one peer is judged as the same connection of any peer of its
    class: a range of flow keys is classified once per class, not once per address. Worked out once:
    which sets hold each address (a selector's members), and the sets over each stretch of addresses
    between the groups' interval ends."""

    def __init__(self, policies: Iterable[CompiledPolicy], direction: str = "inbound") -> None:
        distinct: dict[int, SourceSets] = {}
        for policy in policies:
            for sets in policy.every_source_set(direction):
                distinct.setdefault(id(sets), sets)
        self._members: dict[tuple[int, int], list[int]] = {}
        bounds: dict[int, list[tuple[int, int, int]]] = {4: [], 6: []}  # (address, +1/-1, set)
        for index, sets in enumerate(distinct.values()):
            for family in (4, 6):
                # As SourceSets.contains reads them: a family's addresses if it has any, else intervals.
                if family in sets.addresses:
                    for address in sets.addresses[family]:
                        self._members.setdefault((family, address), []).append(index)
                    continue
                for first, last in sets.intervals.get(family, ()):
                    bounds[family] += [(first, 1, index), (last + 1, -1, index)]
        # Per family: the stretches' first addresses, sorted, and the sets holding each stretch.
        self._stretches: dict[int, tuple[list[int], list[frozenset[int]]]] = {}
        for family, events in bounds.items():
            starts: list[int] = []
            held: list[frozenset[int]] = []
            active: dict[int, int] = {}
            events.sort()
            for at, change, index in events:
                active[index] = active.get(index, 0) + change
                if not active[index]:
                    del active[index]
                if starts and starts[-1] == at:
                    held[-1] = frozenset(active)
                else:
                    starts.append(at)
                    held.append(frozenset(active))
            self._stretches[family] = (starts, held)

    def of(self, peer: str) -> tuple | None:
        """The class of the address `peer`; None for what no rule can name (not a plain address)."""
        try:
            address = parse_host_address(peer)
        except ValueError:
            return None
        family, value = address.version, int(address)
        starts, held = self._stretches[family]
        at = bisect.bisect_right(starts, value) - 1
        return (
            family,
            # ipaddress's is_loopback (127.0.0.0/8, ::1) from the integer: the property cost more
            # than the rest of the class.
            value >> 24 == 127 if family == 4 else value == 1,
            family == 6 and value in _LINK_LOCAL_RANGE,
            tuple(self._members.get((family, value), ())),
            held[at] if at >= 0 else frozenset(),
        )

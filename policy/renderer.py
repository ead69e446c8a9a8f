"""Policy -> the nftables document of one workload (``table inet palisade { ... }``).

Pure: the same inputs give the same bytes (everything is sorted; no clock, no randomness,
no I/O). The agent wraps the document as ``add table``/``delete table``/document in one
batch, so the table is replaced whole and atomically.

Layout. Only inbound connections are judged, in one base chain on the input hook:

* ``visibility``: chain ``observe`` accepts everything; new connections get the ct mark
  ``observed``. No policy rules are installed.
* ``simulation``/``enforced``: chain ``input`` holds the baseline below, then one group of
  nftables rules per policy rule (each sets the ct mark ``allowed | rule number`` and
  accepts), then a terminal rule. In ``simulation`` it sets ``would_block``, logs to NFLOG
  group ``NFLOG_GROUP_WOULD_BLOCK`` and accepts; in ``enforced`` it logs to
  ``NFLOG_GROUP_BLOCKED`` and drops, and ``ct state invalid`` is dropped first (simulation
  accepts those silently, since they are packets rather than connections).

Baseline allowances, in every mode and before any rule, so that no policy can cut the
host off its own network or the agent off the control plane:

* ``ct state established,related`` (replies to connections already admitted, including the
  agent's own stream to the gateway, and ICMP errors about them);
* loopback (``iif "lo"``);
* ICMPv6 neighbour and router discovery and multicast listener messages (without them
  IPv6 stops resolving neighbours);
* DHCPv4 replies (udp 67 -> 68) and DHCPv6 replies from link-local servers (udp 547 -> 546),
  so that leases keep renewing.

In visibility mode the baseline is accepted before the observe mark, so that ``observed``
covers exactly the connections that the other modes judge.

Scale. A rule's sources become named sets (one IPv4 and one IPv6 set per distinct selector
or address group, ``flags interval; auto-merge``) and its tcp/udp entries a named set of
``inet_proto . inet_service``; icmp/icmpv6 entries match ``meta l4proto``. A rule thus costs
two nftables rules per source (one per family) however many peers it has. A family's rule is left out when the
source has no address of that family, unless the source has no address at all: then both
stay, over empty sets, so that the rule remains visible in ``nft list`` and admits nothing.

The ct mark carries the decision in its high byte and the rule's lifetime number
(``RuleInput.number``: given once when the rule is created and never reused) in the low 24
bits, so a mark names the same rule in every policy version; ``rule_index`` maps the numbers
of one document back to rulesets and rules.
"""

from __future__ import annotations

import bisect
import hashlib
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from policy.grammar import Selector
from policy.render_inputs import (
    PORT_PROTOCOLS,
    AddressGroupInput,
    FleetIndex,
    PortEntry,
    RuleInput,
    RulesetInput,
    WorkloadInput,
    parse_network,
)

TABLE_FAMILY = "inet"
TABLE_NAME = "palisade"

DECISION_OBSERVED = 1
DECISION_ALLOWED = 2
DECISION_WOULD_BLOCK = 3
DECISION_BLOCKED = 4
DECISION_NAMES = {
    DECISION_OBSERVED: "observed",
    DECISION_ALLOWED: "allowed",
    DECISION_WOULD_BLOCK: "would_block",
    DECISION_BLOCKED: "blocked",
}
DECISION_SHIFT = 24
RULE_NUMBER_MASK = (1 << DECISION_SHIFT) - 1
MAX_RULES = RULE_NUMBER_MASK

NFLOG_GROUP_WOULD_BLOCK = 7301
NFLOG_GROUP_BLOCKED = 7302

# nftables refuses comments longer than 128 bytes.
_COMMENT_BYTES = 120
_ELEMENTS_PER_LINE = 8


def encode_mark(decision: int, rule_number: int = 0) -> int:
    if decision not in DECISION_NAMES or not 0 <= rule_number <= MAX_RULES:
        raise ValueError(f"cannot encode decision {decision!r} with rule {rule_number!r}")
    return decision << DECISION_SHIFT | rule_number


def decode_mark(mark: int) -> tuple[str | None, int | None]:
    """(decision name, rule number) of a ct mark; None for what Palisade did not set."""
    decision = DECISION_NAMES.get(mark >> DECISION_SHIFT) if 0 <= mark < 1 << 32 else None
    if decision is None:
        return None, None
    return decision, (mark & RULE_NUMBER_MASK) or None


@dataclass(frozen=True)
class RenderedDocument:
    document: str
    rule_index: dict[int, dict]
    version: str


def applicable_rulesets(workload: WorkloadInput, rulesets: Iterable[RulesetInput]) -> list[RulesetInput]:
    """The rulesets whose scope matches the workload's labels, in rule-numbering order."""
    chosen = [rs for rs in rulesets if rs.scope.matches(workload.labels)]
    chosen.sort(key=_ruleset_order)
    return chosen


def render(
    workload: WorkloadInput,
    rulesets: Sequence[RulesetInput],
    groups: Mapping[str, AddressGroupInput],
    fleet: FleetIndex,
) -> RenderedDocument:
    if workload.mode == "visibility":
        document = _observe_document()
        return RenderedDocument(document, {}, _version(document))

    blocks: list[str] = []
    rule_index: dict[int, dict] = {}
    sets: dict[str, str] = {}
    for ruleset in _applicable(workload, rulesets, fleet):
        text, block_sets, entries = _ruleset_block(ruleset, groups, fleet)
        blocks.append(text)
        sets.update(block_sets)
        for number, entry in entries:
            if number in rule_index:
                raise ValueError(f"rule number {number} is given to two rules")
            rule_index[number] = dict(entry)

    enforced = workload.mode == "enforced"
    parts = [f"table {TABLE_FAMILY} {TABLE_NAME} {{\n", _table_comment(workload.mode)]
    parts.extend(sets[name] for name in sorted(sets))
    parts.append(_CHAIN_HEAD.format(name="input"))
    parts.append(_ESTABLISHED)
    parts.append(_INVALID_ENFORCED if enforced else _INVALID_SIMULATION)
    parts.append(_BASELINE)
    parts.extend(blocks)
    parts.append(_TERMINAL_ENFORCED if enforced else _TERMINAL_SIMULATION)
    parts.append("\t}\n}\n")
    document = "".join(parts)
    return RenderedDocument(document, rule_index, _version(document))


# --- fixed text ------------------------------------------------------------------------

_CHAIN_HEAD = "\tchain {name} {{\n\t\ttype filter hook input priority filter; policy accept;\n"
_ESTABLISHED = '\t\tct state established,related accept comment "baseline: replies to admitted connections"\n'
_BASELINE = (
    '\t\tiif "lo" accept comment "baseline: loopback"\n'
    "\t\ticmpv6 type { nd-router-advert, nd-neighbor-solicit, nd-neighbor-advert, nd-redirect, "
    "mld-listener-query, mld-listener-report, mld-listener-done, mld2-listener-report } "
    'accept comment "baseline: IPv6 neighbour/router discovery, multicast listeners"\n'
    '\t\tudp sport 67 udp dport 68 accept comment "baseline: DHCPv4 replies"\n'
    '\t\tip6 saddr fe80::/10 udp sport 547 udp dport 546 accept comment "baseline: DHCPv6 replies"\n'
)
_INVALID_ENFORCED = '\t\tct state invalid drop comment "not part of any valid connection"\n'
_INVALID_SIMULATION = '\t\tct state invalid accept comment "enforced mode drops these, unlogged"\n'
_TERMINAL_SIMULATION = (
    f"\t\tct mark set {DECISION_WOULD_BLOCK << DECISION_SHIFT:#010x} "
    f"log group {NFLOG_GROUP_WOULD_BLOCK} queue-threshold 1 accept "
    'comment "no rule admits this: would block"\n'
)
_TERMINAL_ENFORCED = (
    f"\t\tct mark set {DECISION_BLOCKED << DECISION_SHIFT:#010x} "
    f"log group {NFLOG_GROUP_BLOCKED} queue-threshold 1 drop "
    'comment "no rule admits this: blocked"\n'
)


def _table_comment(mode: str) -> str:
    return f'\tcomment "managed by palisade, mode {mode}; replaced whole on every update"\n\n'


def _observe_document() -> str:
    return "".join(
        (
            f"table {TABLE_FAMILY} {TABLE_NAME} {{\n",
            _table_comment("visibility"),
            _CHAIN_HEAD.format(name="observe"),
            _ESTABLISHED,
            _BASELINE,
            f"\t\tct state new ct mark set {DECISION_OBSERVED << DECISION_SHIFT:#010x} accept "
            'comment "observed: recorded, not judged"\n',
            "\t}\n}\n",
        )
    )


def _version(document: str) -> str:
    return "sha256:" + hashlib.sha256(document.encode()).hexdigest()[:32]


def _comment(text: str) -> str:
    clean = "".join(" " if c == '"' or not c.isprintable() else c for c in text).strip()
    encoded = clean.encode()
    if len(encoded) > _COMMENT_BYTES:
        clean = encoded[: _COMMENT_BYTES - 3].decode(errors="ignore") + "..."
    return f'"{clean}"'


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _ruleset_order(ruleset: RulesetInput) -> tuple[str, str]:
    return ruleset.name, ruleset.id


# --- applicable rulesets, memoised per fleet ----------------------------------------------


def _applicable(
    workload: WorkloadInput, rulesets: Sequence[RulesetInput], fleet: FleetIndex
) -> Sequence[RulesetInput]:
    position = fleet.position_of(workload.id)
    if position is None or fleet.labels[position] != workload.labels:
        return applicable_rulesets(workload, rulesets)
    # One pass over each scope's matching positions serves the whole fleet. The entry keeps
    # the rulesets themselves so that the ids in its key cannot be reused by other objects.
    key = ("applicable", tuple(map(id, rulesets)))
    entry = fleet.memo.get(key)
    if entry is None:
        per_position: dict[int, list[RulesetInput]] = {}
        for ruleset in sorted(rulesets, key=_ruleset_order):
            for p in fleet.positions_matching(ruleset.scope):
                per_position.setdefault(p, []).append(ruleset)
        entry = fleet.memo[key] = (tuple(rulesets), per_position)
    return entry[1].get(position, ())


# --- rules: compiled once per ruleset object, numbered per document ------------------------


@dataclass(frozen=True)
class _Line:
    source: tuple[str, str] | None  # ("sel", canonical selector) / ("grp", group id); None = any
    family: int  # 4 or 6: which of the source's sets the line reads (ignored for "any")
    match: str  # the nftables match, without the verdict
    uses_service_set: bool
    l4proto: str | None = None  # "icmp"/"icmpv6" for the ICMP lines (policy.classify reads it)


@dataclass(frozen=True)
class _CompiledRule:
    lines: tuple[_Line, ...]
    selectors: dict[str, Selector]  # canonical text -> selector, for the sets of "sel" sources
    group_ids: tuple[str, ...]  # of the "grp" sources
    service_set: tuple[str, str] | None  # (name, definition)
    comment: str  # ' comment "..."'
    # The service set's elements as (protocol, first port, last port), for policy.classify.
    service_ranges: tuple[tuple[str, int, int], ...] = ()


def _compiled_ruleset(ruleset: RulesetInput, fleet: FleetIndex) -> list[tuple[RuleInput, _CompiledRule]]:
    key = ("ruleset", id(ruleset))
    entry = fleet.memo.get(key)
    if entry is None or entry[0] is not ruleset:
        rules = sorted(ruleset.rules, key=lambda r: (r.position, r.id))
        entry = fleet.memo[key] = (ruleset, [(r, _compile_rule(ruleset, r)) for r in rules])
    return entry[1]


def _compile_rule(ruleset: RulesetInput, rule: RuleInput) -> _CompiledRule:
    service_ranges = _service_ranges(rule.entries)
    service_set = _service_set(service_ranges)
    protocols = {e.protocol for e in rule.entries}
    # (family, match after the source part, reads the service set, ICMP protocol)
    matches: list[tuple[int, str, bool, str | None]] = []
    if service_set is not None:
        service_match = f"meta l4proto . th dport @{service_set[0]}"
        matches += [(4, service_match, True, None), (6, service_match, True, None)]
    if "icmp" in protocols:
        matches.append((4, "meta l4proto icmp", False, "icmp"))
    if "icmpv6" in protocols:
        matches.append((6, "meta l4proto ipv6-icmp", False, "icmpv6"))

    lines: list[_Line] = []
    selectors: dict[str, Selector] = {}
    if any(s.kind == "any" for s in rule.sources):
        # "any" admits every source address, so the rule's other sources add nothing.
        seen = set()
        for family, match, uses_service, l4proto in matches:
            if match not in seen:
                seen.add(match)
                lines.append(_Line(None, family, match, uses_service, l4proto))
    else:
        sources: set[tuple[str, str]] = set()
        for s in rule.sources:
            if s.selector is not None:
                selectors[str(s.selector)] = s.selector
                sources.add(("sel", str(s.selector)))
            elif s.address_group_id is not None:
                sources.add(("grp", s.address_group_id))
        for source in sorted(sources):
            base = _set_base(source)
            for family, match, uses_service, l4proto in matches:
                saddr = "ip saddr" if family == 4 else "ip6 saddr"
                lines.append(
                    _Line(source, family, f"{saddr} @{base}_v{family} {match}", uses_service, l4proto)
                )
    description = f"{ruleset.name} #{rule.position}" + (f": {rule.description}" if rule.description else "")
    group_ids = tuple(
        sorted({key for kind, key in (line.source for line in lines if line.source) if kind == "grp"})
    )
    return _CompiledRule(
        tuple(lines),
        selectors,
        group_ids,
        service_set,
        f" comment {_comment(description)}",
        tuple((protocol, low, high) for protocol, ranges in service_ranges for low, high in ranges),
    )


def _ruleset_block(
    ruleset: RulesetInput, groups: Mapping[str, AddressGroupInput], fleet: FleetIndex
) -> tuple[str, tuple[tuple[str, str], ...], tuple[tuple[int, dict], ...]]:
    """A ruleset's chain lines, their sets, and its rules' (number, rule-index entry); the same for
    every workload it applies to, so memoised."""
    compiled_rules = _compiled_ruleset(ruleset, fleet)
    referenced = tuple(groups.get(g) for _, c in compiled_rules for g in c.group_ids)
    key = ("block", id(ruleset), tuple(map(id, referenced)))
    entry = fleet.memo.get(key)
    if entry is not None:
        return entry[1]
    lines: list[str] = []
    sets: dict[str, str] = {}
    entries = []
    for rule, compiled in compiled_rules:
        if not 0 < rule.number <= MAX_RULES:
            raise ValueError(f"rule {rule.id} has no lifetime number (1-{MAX_RULES}): {rule.number!r}")
        heads, rule_sets = _resolved(compiled, groups, fleet)
        tail = f"{encode_mark(DECISION_ALLOWED, rule.number):#010x} accept{compiled.comment}\n"
        lines.extend(head + tail for head in heads)
        sets.update(rule_sets)
        entries.append(
            (
                rule.number,
                {
                    "ruleset_id": ruleset.id,
                    "ruleset_name": ruleset.name,
                    "rule_id": rule.id,
                    "position": rule.position,
                },
            )
        )
    found = ("".join(lines), tuple(sets.items()), tuple(entries))
    fleet.memo[key] = ((ruleset, referenced), found)
    return found


def _resolved(
    compiled: _CompiledRule, groups: Mapping[str, AddressGroupInput], fleet: FleetIndex
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The rule's lines up to the mark value, and the sets they read, for these groups.

    Memoised per compiled rule and the group objects it reads (kept in the entry, so that
    their ids stay theirs): only the rule number differs between documents.
    """
    referenced = tuple(groups.get(g) for g in compiled.group_ids)
    key = ("resolved", id(compiled), tuple(map(id, referenced)))
    entry = fleet.memo.get(key)
    if entry is not None:
        return entry[1]
    heads: list[str] = []
    sets: dict[str, str] = {}
    for line in compiled.lines:
        if line.source is not None:
            source = _source_sets(line.source, compiled, groups, fleet)
            if not source.has[line.family] and (source.has[4] or source.has[6]):
                continue
            name, definition = source.sets[line.family]
            sets[name] = definition
        if line.uses_service_set and compiled.service_set is not None:  # the set exists when a line uses it
            name, definition = compiled.service_set
            sets[name] = _claimed(fleet, name, definition, definition)
        heads.append(f"\t\t{line.match} ct mark set ")
    found = (tuple(heads), tuple(sets.items()))
    fleet.memo[key] = (referenced, found)
    return found


# --- named sets ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _SourceSets:
    sets: dict[int, tuple[str, str]]  # family -> (set name, definition)
    has: dict[int, bool]  # family -> the set has elements
    # What the elements hold, for policy.classify: family -> sorted, disjoint (first, last)
    # address intervals (a group's collapsed networks), or the addresses themselves (a selector's).
    intervals: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    addresses: dict[int, frozenset[int]] = field(default_factory=dict)

    def contains(self, family: int, address: int) -> bool:
        if family in self.addresses:
            return address in self.addresses[family]
        intervals = self.intervals.get(family, ())
        at = bisect.bisect_right(intervals, (address, _NO_ADDRESS)) - 1
        return at >= 0 and intervals[at][0] <= address <= intervals[at][1]


_NO_ADDRESS = 1 << 128  # above every address: bisects to the last interval starting at or below one


def _set_base(source: tuple[str, str]) -> str:
    kind, key = source
    return f"{kind}_{_short_hash(key)}"


def _claimed(fleet: FleetIndex, name: str, owner: object, definition: str) -> str:
    # Set names are short hashes: two owners of one name would silently swap their peers.
    if fleet.memo.setdefault(("set-name", name), owner) != owner:
        raise ValueError(f"set name {name} stands for two different sources; the renderer needs longer names")
    return definition


def _source_sets(
    source: tuple[str, str],
    compiled: _CompiledRule,
    groups: Mapping[str, AddressGroupInput],
    fleet: FleetIndex,
) -> _SourceSets:
    kind, key = source
    if kind == "grp":
        group = groups.get(key)
        if group is None:
            raise ValueError(f"a rule refers to address group {key!r}, which is not among the groups")
        entry = fleet.memo.get(("grp", id(group)))
        if entry is None or entry[0] is not group:
            entry = fleet.memo[("grp", id(group))] = (group, _group_sets(group, fleet))
        return entry[1]
    found = fleet.memo.get(("sel", key))
    if found is None:
        found = fleet.memo[("sel", key)] = _selector_sets(compiled.selectors[key], fleet)
    return found


def _selector_sets(selector: Selector, fleet: FleetIndex) -> _SourceSets:
    selector_text = str(selector)
    four, six = fleet.address_values_matching(selector)
    label = f"peers: {selector_text}" if selector_text else "peers: every workload"
    base = _set_base(("sel", selector_text))
    found = {}
    for family, values in ((4, four), (6, six)):
        name = f"{base}_v{family}"
        definition = _set_definition(name, family, label, _host_elements(values, family))
        found[family] = (name, _claimed(fleet, name, ("sel", selector_text), definition))
    return _SourceSets(found, {4: bool(four), 6: bool(six)}, addresses={4: four, 6: six})


def _group_sets(group: AddressGroupInput, fleet: FleetIndex) -> _SourceSets:
    networks: dict[int, list] = {4: [], 6: []}
    for member in group.members:
        try:
            network = parse_network(member)
        except ValueError as error:
            raise ValueError(f"address group {group.name!r}: bad member {member!r}: {error}") from None
        networks[network.version].append(network)
    label = f"address group {group.name}"
    base = _set_base(("grp", group.id))
    found = {}
    intervals = {}
    for family in (4, 6):
        name = f"{base}_v{family}"
        collapsed = list(ipaddress.collapse_addresses(networks[family]))
        elements = [_network_text(n) for n in collapsed]
        definition = _set_definition(name, family, label, elements)
        found[family] = (name, _claimed(fleet, name, ("grp", group.id), definition))
        intervals[family] = tuple((int(n.network_address), int(n.broadcast_address)) for n in collapsed)
    return _SourceSets(found, {4: bool(networks[4]), 6: bool(networks[6])}, intervals=intervals)


def _host_elements(values: Iterable[int], family: int) -> list[str]:
    # One element per peer, even where nft will merge neighbours into a prefix: the stored
    # document is what an operator reads to see which peers a rule admits.
    make = ipaddress.IPv4Address if family == 4 else ipaddress.IPv6Address
    return [str(make(value)) for value in sorted(values)]


def _network_text(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> str:
    if network.prefixlen == network.max_prefixlen:
        return str(network.network_address)
    return str(network)


def _set_definition(name: str, family: int, label: str, elements: list[str]) -> str:
    head = (
        f"\tset {name} {{\n\t\ttype {'ipv4_addr' if family == 4 else 'ipv6_addr'}\n"
        f"\t\tflags interval\n\t\tauto-merge\n\t\tcomment {_comment(label)}\n"
    )
    return head + _elements_text(elements) + "\t}\n\n"


def _elements_text(elements: list[str]) -> str:
    if not elements:
        return ""
    rows = [
        ", ".join(elements[i : i + _ELEMENTS_PER_LINE]) for i in range(0, len(elements), _ELEMENTS_PER_LINE)
    ]
    return "\t\telements = { " + ",\n\t\t\t     ".join(rows) + " }\n"


def _service_ranges(entries: Iterable[PortEntry]) -> list[tuple[str, list[list[int]]]]:
    """The tcp/udp entries as (protocol, merged [first, last] port ranges), sorted."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for entry in entries:
        if entry.protocol in PORT_PROTOCOLS:
            if entry.port_from is None or entry.port_to is None:
                raise ValueError(f"{entry.protocol} entry without ports")
            ranges.setdefault(entry.protocol, []).append((entry.port_from, entry.port_to))
    found = []
    for protocol in sorted(ranges):
        # Interval sets of concatenations do not merge overlaps themselves: merge here.
        merged: list[list[int]] = []
        for low, high in sorted(ranges[protocol]):
            if merged and low <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], high)
            else:
                merged.append([low, high])
        found.append((protocol, merged))
    return found


def _service_set(service_ranges: list[tuple[str, list[list[int]]]]) -> tuple[str, str] | None:
    if not service_ranges:
        return None
    elements = []
    for protocol, merged in service_ranges:
        for low, high in merged:
            elements.append(f"{protocol} . {low}" if low == high else f"{protocol} . {low}-{high}")
    name = f"svc_{_short_hash(','.join(elements))}"
    definition = (
        f"\tset {name} {{\n\t\ttype inet_proto . inet_service\n\t\tflags interval\n"
        + _elements_text(elements)
        + "\t}\n\n"
    )
    return name, definition

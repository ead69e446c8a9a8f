"""Policy -> the nftables document of one workload (``table inet palisade { ... }``).

Pure: the same inputs give the same bytes (everything is sorted; no clock, no randomness,
no I/O). The agent wraps the document as ``add table``/``delete table``/document in one
batch, so the table is replaced whole and atomically.

Layout. Only inbound connections are judged, in one base chain on the input hook:

* ``visibility``: chain ``observe`` accepts everything; new connections get the ct mark
  ``observed``. No policy rules are installed.
* ``simulation``/``enforced``: chain ``input`` holds the baseline below, then the deny rules of
  every applicable ruleset (each sets the ct mark ``would_block | rule number`` and accepts in
  simulation; ``blocked | rule number``, logs with the prefix ``palisade:in:<number>`` and drops in
  enforced), then one group of nftables rules per allow rule (each sets the ct mark
  ``allowed | rule number`` and accepts), then a terminal rule. A policy without deny rules renders
  exactly as before deny rules existed. In ``simulation`` it sets ``would_block``, logs to NFLOG
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


# The NFLOG prefixes of the blocked group, one scheme: `palisade:<in|out>[:<rule number>]`. A dropped
# packet never becomes a conntrack entry, so the prefix carries what a mark would: the direction and
# the deny rule that refused it. The inbound terminal drop keeps no prefix (as it always has). The
# agent parses them (agent/nflog.py parse_prefix); tests/agent keeps the two equal.
LOG_PREFIX_INBOUND = "palisade:in"
LOG_PREFIX_OUTBOUND = "palisade:out"


def blocked_log_prefix(*, outbound: bool, rule_number: int | None = None) -> str:
    """`palisade:in:N` (inbound deny N), `palisade:out` (outbound terminal), `palisade:out:N`."""
    head = LOG_PREFIX_OUTBOUND if outbound else LOG_PREFIX_INBOUND
    return head if rule_number is None else f"{head}:{rule_number}"


def deny_log_prefix(rule_number: int, *, outbound: bool = False) -> str:
    return blocked_log_prefix(outbound=outbound, rule_number=rule_number)


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
    """The document of `workload` under the policy (`rulesets`, `groups`) in `fleet`."""
    if workload.mode == "visibility":
        document = _observe_document()
        return RenderedDocument(document, {}, _version(document))
    return compile_policy(rulesets, groups, fleet).render(workload)


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


# --- the compiled policy: what every document of a fleet is rendered from ---------------------


@dataclass(frozen=True)
class Line:
    """One nftables line of a compiled rule (a rule has one per source and family it matches)."""

    source: tuple[str, str] | None  # ("sel", canonical selector) / ("grp", group id); None = any
    family: int  # 4 or 6: which of the source's sets the line reads (ignored for "any")
    match: str  # the nftables match, without the verdict
    uses_service_set: bool
    l4proto: str | None = None  # "icmp"/"icmpv6" for the ICMP lines (policy.classify reads it)


@dataclass(frozen=True)
class CompiledRule:
    """A rule as its lines, the same in every document it is in; only its number's mark differs."""

    lines: tuple[Line, ...]
    selectors: dict[str, Selector]  # canonical text -> selector, for the sets of "sel" sources
    group_ids: tuple[str, ...]  # of the "grp" sources
    service_set: tuple[str, str] | None  # (name, definition)
    comment: str  # ' comment "..."'
    # The service set's elements as (protocol, first port, last port), for policy.classify.
    service_ranges: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class _Block:
    """A ruleset's chain lines (its allow rules'; its deny rules' as simulation and as enforced
    judge them), the sets they read, and its rules' (number, rule-index entry)."""

    allow: str
    deny_simulation: str
    deny_enforced: str
    sets: tuple[tuple[str, str], ...]
    entries: tuple[tuple[int, dict], ...]


class CompiledRuleset:
    """A ruleset's rules in chain order, each compiled once (on first use)."""

    def __init__(self, ruleset: RulesetInput) -> None:
        self.ruleset = ruleset
        self._rules: tuple[tuple[RuleInput, CompiledRule], ...] | None = None

    @property
    def rules(self) -> tuple[tuple[RuleInput, CompiledRule], ...]:
        if self._rules is None:
            ordered = sorted(self.ruleset.rules, key=lambda r: (r.position, r.id))
            self._rules = tuple((r, _compile_rule(self.ruleset, r)) for r in ordered)
        return self._rules


class CompiledPolicy:
    """A policy (`rulesets`, `groups`) compiled against one fleet: which rulesets apply to each
    workload, their rules' lines and the sets of their sources. The renderer writes every document
    from it and the classifier (policy/classify.py) walks it, so the two cannot disagree about order,
    selectors resolved to the fleet's addresses now, address groups, services, ranges, ICMP and `any`.
    Everything is worked out on first use and kept: a ruleset's chain lines are the same for every
    workload it applies to."""

    def __init__(
        self, rulesets: Sequence[RulesetInput], groups: Mapping[str, AddressGroupInput], fleet: FleetIndex
    ) -> None:
        self.rulesets = tuple(rulesets)
        self.groups = groups
        self.fleet = fleet
        self._ordered = [CompiledRuleset(r) for r in sorted(self.rulesets, key=_ruleset_order)]
        self._per_position: dict[int, list[CompiledRuleset]] | None = None
        self._group_sets: dict[str, SourceSets] = {}
        self._blocks: dict[CompiledRuleset, _Block] = {}

    def applicable(self, workload: WorkloadInput) -> Sequence[CompiledRuleset]:
        """The rulesets whose scope matches the workload's labels, in rule-numbering order."""
        position = self.fleet.position_of(workload.id)
        if position is None or self.fleet.labels[position] != workload.labels:
            return [r for r in self._ordered if r.ruleset.scope.matches(workload.labels)]
        if self._per_position is None:
            # One pass over each scope's matching positions serves the whole fleet.
            self._per_position = {}
            for compiled in self._ordered:
                for p in self.fleet.positions_matching(compiled.ruleset.scope):
                    self._per_position.setdefault(p, []).append(compiled)
        return self._per_position.get(position, ())

    def source_sets(self, source: tuple[str, str], rule: CompiledRule) -> SourceSets:
        """The sets of a line's source: a selector's peers in this fleet, or an address group's members."""
        kind, key = source
        if kind == "grp":
            found = self._group_sets.get(key)
            if found is None:
                group = self.groups.get(key)
                if group is None:
                    raise ValueError(f"a rule refers to address group {key!r}, which is not among the groups")
                found = self._group_sets[key] = _group_sets(group, self.fleet)
            return found
        # A selector's sets depend on the fleet alone: kept in its index, shared by every policy.
        found = self.fleet.memo.get(("sel", key))
        if found is None:
            found = self.fleet.memo[("sel", key)] = _selector_sets(rule.selectors[key], self.fleet)
        return found

    def render(self, workload: WorkloadInput) -> RenderedDocument:
        if workload.mode == "visibility":
            document = _observe_document()
            return RenderedDocument(document, {}, _version(document))
        enforced = workload.mode == "enforced"
        blocks: list[str] = []
        denies: list[str] = []
        rule_index: dict[int, dict] = {}
        sets: dict[str, str] = {}
        for compiled in self.applicable(workload):
            block = self._block(compiled)
            blocks.append(block.allow)
            denies.append(block.deny_enforced if enforced else block.deny_simulation)
            sets.update(block.sets)
            for number, entry in block.entries:
                if number in rule_index:
                    raise ValueError(f"rule number {number} is given to two rules")
                rule_index[number] = dict(entry)

        parts = [f"table {TABLE_FAMILY} {TABLE_NAME} {{\n", _table_comment(workload.mode)]
        parts.extend(sets[name] for name in sorted(sets))
        parts.append(_CHAIN_HEAD.format(name="input"))
        parts.append(_ESTABLISHED)
        parts.append(_INVALID_ENFORCED if enforced else _INVALID_SIMULATION)
        parts.append(_BASELINE)
        # Every deny rule of every applicable ruleset before the first allow: no allow can undo a deny.
        parts.extend(denies)
        parts.extend(blocks)
        parts.append(_TERMINAL_ENFORCED if enforced else _TERMINAL_SIMULATION)
        parts.append("\t}\n}\n")
        document = "".join(parts)
        return RenderedDocument(document, rule_index, _version(document))

    def _block(self, compiled: CompiledRuleset) -> _Block:
        """A ruleset's chain lines, their sets, and its rules' (number, rule-index entry): the same for
        every workload it applies to."""
        found = self._blocks.get(compiled)
        if found is not None:
            return found
        ruleset = compiled.ruleset
        lines: list[str] = []
        simulation: list[str] = []
        enforced: list[str] = []
        sets: dict[str, str] = {}
        entries = []
        for rule, rule_compiled in compiled.rules:
            if not 0 < rule.number <= MAX_RULES:
                raise ValueError(f"rule {rule.id} has no lifetime number (1-{MAX_RULES}): {rule.number!r}")
            heads, rule_sets = self._resolved(rule_compiled)
            entry = {
                "ruleset_id": ruleset.id,
                "ruleset_name": ruleset.name,
                "rule_id": rule.id,
                "position": rule.position,
            }
            if rule.action == "deny":
                # Logged like the terminal rule (the NFLOG prefix names the rule of a dropped packet,
                # which never becomes a conntrack entry), but marked with the deny rule's number.
                entry["action"] = "deny"
                would_block = (
                    f"{encode_mark(DECISION_WOULD_BLOCK, rule.number):#010x} "
                    f"log group {NFLOG_GROUP_WOULD_BLOCK} queue-threshold 1 accept{rule_compiled.comment}\n"
                )
                blocked = (
                    f"{encode_mark(DECISION_BLOCKED, rule.number):#010x} "
                    f'log prefix "{deny_log_prefix(rule.number)}" group {NFLOG_GROUP_BLOCKED} '
                    f"queue-threshold 1 drop{rule_compiled.comment}\n"
                )
                simulation.extend(head + would_block for head in heads)
                enforced.extend(head + blocked for head in heads)
            else:
                tail = f"{encode_mark(DECISION_ALLOWED, rule.number):#010x} accept{rule_compiled.comment}\n"
                lines.extend(head + tail for head in heads)
            sets.update(rule_sets)
            entries.append((rule.number, entry))
        found = self._blocks[compiled] = _Block(
            "".join(lines), "".join(simulation), "".join(enforced), tuple(sets.items()), tuple(entries)
        )
        return found

    def _resolved(self, rule: CompiledRule) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
        """The rule's lines up to the mark value, and the sets they read."""
        heads: list[str] = []
        sets: dict[str, str] = {}
        for line in rule.lines:
            if line.source is not None:
                source = self.source_sets(line.source, rule)
                if not source.has[line.family] and (source.has[4] or source.has[6]):
                    continue
                name, definition = source.sets[line.family]
                sets[name] = definition
            if line.uses_service_set and rule.service_set is not None:  # the set exists when a line uses it
                name, definition = rule.service_set
                sets[name] = _claimed(self.fleet, name, definition, definition)
            heads.append(f"\t\t{line.match} ct mark set ")
        return tuple(heads), tuple(sets.items())


def compile_policy(
    rulesets: Sequence[RulesetInput], groups: Mapping[str, AddressGroupInput], fleet: FleetIndex
) -> CompiledPolicy:
    """The policy compiled against `fleet`, once for the same ruleset and group objects: rendering every
    workload of a fleet, or classifying each of its flow keys, compiles its policy once. Kept in the
    fleet index by the identity of those objects; the compiled policy holds them, so that their ids
    cannot be taken by other objects while it is kept."""
    key = ("policy", tuple(map(id, rulesets)), tuple((name, id(group)) for name, group in groups.items()))
    found = fleet.memo.get(key)
    if found is None:
        found = fleet.memo[key] = CompiledPolicy(rulesets, groups, fleet)
    return found


def _compile_rule(ruleset: RulesetInput, rule: RuleInput) -> CompiledRule:
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

    lines: list[Line] = []
    selectors: dict[str, Selector] = {}
    if any(s.kind == "any" for s in rule.sources):
        # "any" admits every source address, so the rule's other sources add nothing.
        seen = set()
        for family, match, uses_service, l4proto in matches:
            if match not in seen:
                seen.add(match)
                lines.append(Line(None, family, match, uses_service, l4proto))
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
                    Line(source, family, f"{saddr} @{base}_v{family} {match}", uses_service, l4proto)
                )
    description = f"{ruleset.name} #{rule.position}" + (f": {rule.description}" if rule.description else "")
    group_ids = tuple(
        sorted({key for kind, key in (line.source for line in lines if line.source) if kind == "grp"})
    )
    return CompiledRule(
        tuple(lines),
        selectors,
        group_ids,
        service_set,
        f" comment {_comment(description)}",
        tuple((protocol, low, high) for protocol, ranges in service_ranges for low, high in ranges),
    )


# --- named sets ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceSets:
    """A source's named sets, one per family, and what they hold."""

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


def _selector_sets(selector: Selector, fleet: FleetIndex) -> SourceSets:
    selector_text = str(selector)
    four, six = fleet.address_values_matching(selector)
    label = f"peers: {selector_text}" if selector_text else "peers: every workload"
    base = _set_base(("sel", selector_text))
    found = {}
    for family, values in ((4, four), (6, six)):
        name = f"{base}_v{family}"
        definition = _set_definition(name, family, label, _host_elements(values, family))
        found[family] = (name, _claimed(fleet, name, ("sel", selector_text), definition))
    return SourceSets(found, {4: bool(four), 6: bool(six)}, addresses={4: four, 6: six})


def _group_sets(group: AddressGroupInput, fleet: FleetIndex) -> SourceSets:
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
    return SourceSets(found, {4: bool(networks[4]), 6: bool(networks[6])}, intervals=intervals)


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

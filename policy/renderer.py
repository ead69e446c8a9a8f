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
import functools
import hashlib
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from agent.gateway_sets import GATEWAY_SETS  # noqa: F401 - the documents' gateway sets, named by the agent
from agent.outbound_observe import ESTABLISHED, GATEWAY_SET_DEFINITIONS, OUTPUT_BASELINE, OUTPUT_HEAD
from policy.grammar import Selector
from policy.render_inputs import (
    PORT_PROTOCOLS,
    AddressGroupInput,
    FleetIndex,
    PortEntry,
    RuleInput,
    RulesetInput,
    WorkloadInput,
    parse_host_address,
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
# Flags beside the decision in the mark's high byte: (flags | decision) << 24 | rule number. Inbound
# marks carry none, exactly as before outbound existed; the agent reads both (docs/policy.md).
DIRECTION_OUTBOUND_FLAG = 0x80  # the workload opened the connection (the output chain marked it)
FAILSAFE_FLAG = 0x40  # admitted by the fail-safe list (rule number 0)
_DECISION_BITS = 0x3F

# The fail-safe list's default: DNS and NTP to any destination (settings.PALISADE_OUTBOUND_FAILSAFE).
DEFAULT_OUTBOUND_FAILSAFE = (PortEntry("udp", 53), PortEntry("tcp", 53), PortEntry("udp", 123))
# GATEWAY_SETS (agent/gateway_sets.py): the sets the agent fills at apply time with the control-plane
# addresses it uses; the rendered document holds them empty, so a stale document can never leave the
# agent's own gateway out.

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


def encode_mark(decision: int, rule_number: int = 0, flags: int = 0) -> int:
    if (
        decision not in DECISION_NAMES
        or not 0 <= rule_number <= MAX_RULES
        or flags & ~(DIRECTION_OUTBOUND_FLAG | FAILSAFE_FLAG)
    ):
        raise ValueError(f"cannot encode decision {decision!r} with rule {rule_number!r}, flags {flags!r}")
    return (flags | decision) << DECISION_SHIFT | rule_number


@dataclass(frozen=True)
class Mark:
    direction: str  # inbound, outbound
    decision: str
    rule: int | None
    failsafe: bool = False


def decode_any_mark(mark: int) -> Mark | None:
    """A ct mark of either direction; None for what Palisade did not set. (``decode_mark`` reads the
    inbound ones only, as it always did.)"""
    if not 0 <= mark < 1 << 32:
        return None
    high = mark >> DECISION_SHIFT
    decision = DECISION_NAMES.get(high & _DECISION_BITS)
    outbound = bool(high & DIRECTION_OUTBOUND_FLAG)
    failsafe = bool(high & FAILSAFE_FLAG)
    if decision is None or (failsafe and not outbound):
        return None
    return Mark("outbound" if outbound else "inbound", decision, (mark & RULE_NUMBER_MASK) or None, failsafe)


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
    failsafe: Sequence[PortEntry] = DEFAULT_OUTBOUND_FAILSAFE,
) -> RenderedDocument:
    """The document of `workload` under the policy (`rulesets`, `groups`) in `fleet`."""
    return compile_policy(rulesets, groups, fleet, failsafe=failsafe).render(workload)


# --- fixed text ------------------------------------------------------------------------

_CHAIN_HEAD = "\tchain {name} {{\n\t\ttype filter hook input priority filter; policy accept;\n"
_ESTABLISHED = ESTABLISHED
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


def _table_comment(mode: str, outbound_mode: str = "visibility") -> str:
    outbound = "" if outbound_mode == "visibility" else f", outbound {outbound_mode}"
    return f'\tcomment "managed by palisade, mode {mode}{outbound}; replaced whole on every update"\n\n'


_OBSERVE_CHAIN = "".join(
    (
        _CHAIN_HEAD.format(name="observe"),
        _ESTABLISHED,
        _BASELINE,
        f"\t\tct state new ct mark set {DECISION_OBSERVED << DECISION_SHIFT:#010x} accept "
        'comment "observed: recorded, not judged"\n',
        "\t}\n",
    )
)


def _observe_document() -> str:
    return "".join(
        (f"table {TABLE_FAMILY} {TABLE_NAME} {{\n", _table_comment("visibility"), _OBSERVE_CHAIN, "}\n")
    )


# The output chain's head and baseline and the gateway sets' definitions are the agent's, which adds the
# same baseline to a document without an output chain (outbound visibility).
_OUTPUT_HEAD, _OUTPUT_BASELINE = OUTPUT_HEAD, OUTPUT_BASELINE
_GATEWAY_SET_DEFINITIONS = GATEWAY_SET_DEFINITIONS
_OUT_TERMINAL_SIMULATION = (
    f"\t\tct mark set {encode_mark(DECISION_WOULD_BLOCK, 0, DIRECTION_OUTBOUND_FLAG):#010x} "
    f"log group {NFLOG_GROUP_WOULD_BLOCK} queue-threshold 1 accept "
    'comment "no rule admits this connection out: would block"\n'
)
_OUT_TERMINAL_ENFORCED = (
    f"\t\tct mark set {encode_mark(DECISION_BLOCKED, 0, DIRECTION_OUTBOUND_FLAG):#010x} "
    f'log prefix "{blocked_log_prefix(outbound=True)}" group {NFLOG_GROUP_BLOCKED} queue-threshold 1 drop '
    'comment "no rule admits this connection out: blocked"\n'
)


_PARTS_VERSION_TAG = b"palisade document parts\n"


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
    tail: str = ""  # the match after the address part: the service set, or the ICMP protocol


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


@dataclass(frozen=True)
class PeerLine:
    """A line of the output chain that judges a connection by the destination's own inbound policy
    ("one rule, both ends"): a destination in `scope` (an inbound ruleset's), on the service of the
    inbound rule's `line`, refused (a deny rule) or admitted (an allow rule) by that rule."""

    rule: RuleInput
    compiled: CompiledRule
    scope: Selector
    family: int
    line: Line


# (every inbound rule in chain order with its scope and distinct service lines; per distinct source, its
# sets and the (rule order, family) pairs it appears in; (family, address) -> the selector sources
# holding it, as the orders of the rules reading each; per family, the same of the interval sources
# (address groups) covering each stretch of addresses; the orders of `any` rules)
_PeerIndex = tuple[
    list[tuple[RuleInput, CompiledRule, Selector, tuple[Line, ...]]],
    list[tuple["SourceSets", list[tuple[int, int]]]],
    dict[tuple[int, int], list[frozenset[int]]],
    dict[int, tuple[list[int], list[list[frozenset[int]]]]],
    frozenset[int],
]


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
        self,
        rulesets: Sequence[RulesetInput],
        groups: Mapping[str, AddressGroupInput],
        fleet: FleetIndex,
        failsafe: Sequence[PortEntry] = DEFAULT_OUTBOUND_FAILSAFE,
    ) -> None:
        self.rulesets = tuple(rulesets)
        self.groups = groups
        self.fleet = fleet
        self.failsafe = tuple(failsafe)
        # (protocol, first port, last port) of the fail-safe list, for policy.classify.
        self.failsafe_ranges = tuple(
            (protocol, low, high)
            for protocol, ranges in _service_ranges(self.failsafe)
            for low, high in ranges
        )
        ordered = [CompiledRuleset(r) for r in sorted(self.rulesets, key=_ruleset_order)]
        self._ordered = [r for r in ordered if r.ruleset.direction == "inbound"]
        self._ordered_out = [r for r in ordered if r.ruleset.direction == "outbound"]
        self._per_position: dict[int, list[CompiledRuleset]] | None = None
        self._group_sets: dict[str, SourceSets] = {}
        self._blocks: dict[CompiledRuleset, _Block] = {}
        self._peers: _PeerIndex | None = None
        self._per_position_out: dict[int, list[CompiledRuleset]] | None = None
        self._digests: dict[str, bytes] = {}  # set definition -> its SHA-256 (_parts_version)
        self._entries: dict[int, dict] = {}  # id(inbound rule) -> its rule-index entry
        self._peer_rules: dict[tuple[tuple[int, ...], bool], dict[int, _PeerRule]] = {}

    def applicable(self, workload: WorkloadInput) -> Sequence[CompiledRuleset]:
        """The inbound rulesets whose scope matches the workload's labels, in rule-numbering order."""
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

    def applicable_outbound(self, workload: WorkloadInput) -> Sequence[CompiledRuleset]:
        """The outbound rulesets whose scope matches the workload's labels, in rule-numbering order."""
        position = self.fleet.position_of(workload.id)
        if position is None or self.fleet.labels[position] != workload.labels:
            return [r for r in self._ordered_out if r.ruleset.scope.matches(workload.labels)]
        if self._per_position_out is None:
            self._per_position_out = {}
            for compiled in self._ordered_out:
                for p in self.fleet.positions_matching(compiled.ruleset.scope):
                    self._per_position_out.setdefault(p, []).append(compiled)
        return self._per_position_out.get(position, ())

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
        return self.selector_sets(rule.selectors[key])

    def selector_sets(self, selector: Selector) -> SourceSets:
        # A selector's sets depend on the fleet alone: kept in its index, shared by every policy.
        key = str(selector)
        found = self.fleet.memo.get(("sel", key))
        if found is None:
            found = self.fleet.memo[("sel", key)] = _selector_sets(selector, self.fleet)
        return found

    def destination_set(self, scope: Selector, family: int) -> tuple[str, str]:
        """(name, definition) of the set an output chain reads for the workloads of an inbound scope.
        Every output chain that meets the scope carries it, so where the scope's addresses collapse into
        at most half as many prefixes (neighbouring addresses: a subnet, the whole fleet) it is written
        as those prefixes in a set of its own (``dst_``); otherwise it is the scope's peer set (``sel_``,
        the set a source of the same selector reads: shared with the input chain). The same addresses
        either way (policy.classify asks `selector_sets`)."""
        key = ("dst", str(scope), family)
        found = self.fleet.memo.get(key)
        if found is None:
            values = sorted(self.selector_sets(scope).addresses[family])
            runs = _runs(values)
            found = self.selector_sets(scope).sets[family]
            if 2 * len(runs) <= len(values):
                prefixes = _run_prefixes(runs, family)
                if 2 * len(prefixes) <= len(values):
                    text = str(scope)
                    name = f"{_set_base(('dst', text))}_v{family}"
                    label = f"destinations: {text}" if text else "destinations: every workload"
                    definition = _set_definition(name, family, label, prefixes)
                    found = (name, _claimed(self.fleet, name, ("dst", text), definition))
            self.fleet.memo[key] = found
        return found

    def every_source_set(self, direction: str) -> list[SourceSets]:
        """Every set the peer of a connection of `direction` may be tested against (policy.classify):
        inbound, each inbound rule's sources; outbound, each outbound rule's destinations and each
        inbound ruleset's scope (the output chain's peer lines)."""
        rulesets = self._ordered if direction == "inbound" else self._ordered_out
        found: list[SourceSets] = []
        for compiled in rulesets:
            for _, rule in compiled.rules:
                found += [self.source_sets(line.source, rule) for line in rule.lines if line.source]
        if direction != "inbound":
            found += [self.selector_sets(compiled.ruleset.scope) for compiled in self._ordered]
        return found

    def peer_lines(self, workload: WorkloadInput) -> tuple[list[PeerLine], list[PeerLine]]:
        """(deny, allow) lines of the fleet's inbound rules whose sources hold `workload`'s address:
        its outgoing connections to their scopes' workloads on their services are what those
        workloads' own inbound policy refuses or admits. Rulesets by name, rules by position."""
        rules = self._peer_index()[0]
        denies: list[PeerLine] = []
        allows: list[PeerLine] = []
        for order, families in self._peer_families(workload):
            found = denies if rules[order][0].action == "deny" else allows
            found.extend(self._rule_peer_lines(order, families))
        return denies, allows

    def _rule_peer_lines(self, order: int, families: tuple[int, ...]) -> list[PeerLine]:
        rule, rule_compiled, scope, tails = self._peer_index()[0][order]
        return [
            PeerLine(rule, rule_compiled, scope, family, line)
            for family in families
            for line in tails
            if line.l4proto is None or line.family == family
        ]

    def _peer_families(self, workload: WorkloadInput) -> list[tuple[int, tuple[int, ...]]]:
        """(rule order, families) of the inbound rules with a source holding the workload's address."""
        four, six = self._peer_orders(workload)
        return sorted(
            [(order, (4,)) for order in four - six]
            + [(order, (6,)) for order in six - four]
            + [(order, (4, 6)) for order in four & six]
        )

    def _peer_orders(self, workload: WorkloadInput) -> tuple[set[int], set[int]]:
        """The orders of the inbound rules with a source holding the workload's IPv4 / IPv6 address."""
        _, _, by_address, intervals, any_source = self._peer_index()
        found: list[set[int]] = []
        for family in (4, 6):
            # Each distinct source is asked once, not once per rule that names it: a selector's by the
            # workload's address (an index of every selector set's members), a group's by an index of
            # every group's intervals (which groups cover each stretch of addresses).
            points, covering = intervals[family]
            hit: list[frozenset[int]] = []
            for text in workload.addresses:
                address = parse_host_address(text)
                if address.version != family:
                    continue
                value = int(address)
                hit.append(any_source)
                hit.extend(by_address.get((family, value), ()))
                at = bisect.bisect_right(points, value) - 1
                if at >= 0:
                    hit.extend(covering[at])
            found.append(set().union(*hit))
        return found[0], found[1]

    def _peer_index(self) -> _PeerIndex:
        """Every inbound rule in chain order with its distinct service matches, and which rules each
        distinct source (or `any`) appears in, by family: worked out once per compiled policy."""
        if self._peers is None:
            rules: list[tuple[RuleInput, CompiledRule, Selector, tuple[Line, ...]]] = []
            by_source: dict[tuple[str, str], tuple[CompiledRule, list[tuple[int, int]]]] = {}
            any_source: list[int] = []
            for compiled in self._ordered:
                for rule, rule_compiled in compiled.rules:
                    order = len(rules)
                    tails: dict[str, Line] = {}
                    for line in rule_compiled.lines:
                        tails.setdefault(line.tail, line)
                        if line.source is None:
                            if not any_source or any_source[-1] != order:
                                any_source.append(order)
                        else:
                            by_source.setdefault(line.source, (rule_compiled, []))[1].append(
                                (order, line.family)
                            )
                    rules.append((rule, rule_compiled, compiled.ruleset.scope, tuple(tails.values())))
                    self._entries[id(rule)] = _rule_entry(compiled.ruleset, rule)
            resolved = [(self.source_sets(source, rep), pairs) for source, (rep, pairs) in by_source.items()]
            # Per source and family, the orders of the rules whose lines read it.
            orders = {
                f: [frozenset(order for order, family in pairs if family == f) for _, pairs in resolved]
                for f in (4, 6)
            }
            by_address: dict[tuple[int, int], list[frozenset[int]]] = {}
            interval_sources = []
            for index, (sets, _) in enumerate(resolved):
                if sets.addresses:
                    for family, members in sets.addresses.items():
                        for member in members:
                            by_address.setdefault((family, member), []).append(orders[family][index])
                else:
                    interval_sources.append(index)
            intervals = {}
            for family in (4, 6):
                points, covering = _interval_index(resolved, interval_sources, family)
                intervals[family] = (points, [[orders[family][i] for i in sources] for sources in covering])
            self._peers = (rules, resolved, by_address, intervals, frozenset(any_source))
        return self._peers

    def render(self, workload: WorkloadInput) -> RenderedDocument:
        outbound = workload.outbound_mode != "visibility"
        if workload.mode == "visibility" and not outbound:
            document = _observe_document()
            return RenderedDocument(document, {}, _version(document))
        rule_index: dict[int, dict] = {}
        sets: dict[str, str] = {}
        chains: list[str] = []
        if workload.mode == "visibility":
            chains.append(_OBSERVE_CHAIN)
        else:
            chains.append(self._input_chain(workload, rule_index, sets))
        if outbound:
            chains.append(self._output_chain(workload, rule_index, sets))
        parts = [
            f"table {TABLE_FAMILY} {TABLE_NAME} {{\n",
            _table_comment(workload.mode, workload.outbound_mode),
        ]
        parts += map(sets.__getitem__, sorted(sets))
        if outbound:
            parts.append(_GATEWAY_SET_DEFINITIONS)
        set_parts = range(2, len(parts))
        parts.extend(chains)
        parts.append("}\n")
        document = "".join(parts)
        version = self._parts_version(parts, set_parts) if outbound else _version(document)
        return RenderedDocument(document, rule_index, version)

    def _parts_version(self, parts: Sequence[str], set_parts: range) -> str:
        """The version of a document with an output chain: the SHA-256 of its parts' SHA-256 digests,
        in order (the parts make up the document exactly). Such a document carries the sets of every
        inbound scope that admits its workload, hundreds of KiB that most documents share; each set's
        digest is worked out once per fleet (`set_parts`: where the set definitions are), so only the
        chains are hashed per document. A document without an output chain keeps the SHA-256 of its
        text (`_version`), as it always had."""
        digests = self._digests
        found = [hashlib.sha256(part.encode()).digest() for part in parts[: set_parts.start]]
        found += [
            digests.get(part) or self._set_digest(part) for part in parts[set_parts.start : set_parts.stop]
        ]
        found += [hashlib.sha256(part.encode()).digest() for part in parts[set_parts.stop :]]
        return "sha256:" + hashlib.sha256(_PARTS_VERSION_TAG + b"".join(found)).hexdigest()[:32]

    def _set_digest(self, definition: str) -> bytes:
        found = self._digests[definition] = hashlib.sha256(definition.encode()).digest()
        return found

    def _input_chain(self, workload: WorkloadInput, rule_index: dict[int, dict], sets: dict[str, str]) -> str:
        enforced = workload.mode == "enforced"
        blocks: list[str] = []
        denies: list[str] = []
        for compiled in self.applicable(workload):
            block = self._block(compiled)
            blocks.append(block.allow)
            denies.append(block.deny_enforced if enforced else block.deny_simulation)
            sets.update(block.sets)
            _index(rule_index, block.entries)
        parts = [_CHAIN_HEAD.format(name="input"), _ESTABLISHED]
        parts.append(_INVALID_ENFORCED if enforced else _INVALID_SIMULATION)
        parts.append(_BASELINE)
        # Every deny rule of every applicable ruleset before the first allow: no allow can undo a deny.
        parts.extend(denies)
        parts.extend(blocks)
        parts.append(_TERMINAL_ENFORCED if enforced else _TERMINAL_SIMULATION)
        parts.append("\t}\n")
        return "".join(parts)

    def _output_chain(
        self, workload: WorkloadInput, rule_index: dict[int, dict], sets: dict[str, str]
    ) -> str:
        """Baseline (the gateways among it), the fail-safe list, the workload's own outbound deny rules
        then allows, then its destinations' inbound deny rules then allows, then the terminal."""
        enforced = workload.outbound_mode == "enforced"
        parts = [_OUTPUT_HEAD, _ESTABLISHED, _OUTPUT_BASELINE]
        failsafe_set = _service_set(_service_ranges(self.failsafe), name=FAILSAFE_SET)
        if failsafe_set is not None:
            name, definition = failsafe_set
            sets[name] = definition
            mark = encode_mark(DECISION_ALLOWED, 0, DIRECTION_OUTBOUND_FLAG | FAILSAFE_FLAG)
            parts.append(
                f"\t\tmeta l4proto . th dport @{name} ct mark set {mark:#010x} accept "
                'comment "fail-safe list (PALISADE_OUTBOUND_FAILSAFE)"\n'
            )
        blocks: list[str] = []
        for compiled in self.applicable_outbound(workload):
            block = self._block(compiled)
            parts.append(block.deny_enforced if enforced else block.deny_simulation)
            blocks.append(block.allow)
            sets.update(block.sets)
            _index(rule_index, block.entries)
        parts.extend(blocks)
        # Each inbound rule's lines, sets and index entry are kept per (families, mode): most workloads
        # meet the same inbound rules. Deny lines before allows, each in chain order.
        four, six = self._peer_orders(workload)
        chosen: dict[int, _PeerRule] = {}
        for families, orders in (((4,), four - six), ((6,), six - four), ((4, 6), four & six)):
            if orders:
                kept = self._peer_rules.setdefault((families, enforced), {})
                for order in orders - kept.keys():
                    self._peer_rule(kept, order, families, enforced)
                chosen.update({order: kept[order] for order in orders})
        peers = [peer for peer in map(chosen.__getitem__, sorted(chosen)) if peer.entry is not None]
        parts += [peer.text for peer in peers if peer.deny]
        parts += [peer.text for peer in peers if not peer.deny]
        sets.update([item for peer in peers for item in peer.sets])
        entries = dict([peer.entry for peer in peers])  # type: ignore[misc]  # entry is set for these
        for number in rule_index.keys() & entries.keys():
            if rule_index[number] != entries[number]:
                raise ValueError(f"rule number {number} is given to two rules")
        # Not copied, unlike the blocks' entries: these are made for the index alone and nothing reads
        # an index to change it (a copy each was a tenth of an output chain's time).
        rule_index.update(entries)
        parts.append(_OUT_TERMINAL_ENFORCED if enforced else _OUT_TERMINAL_SIMULATION)
        parts.append("\t}\n")
        return "".join(parts)

    def _peer_rule(
        self, kept: dict[int, _PeerRule], order: int, families: tuple[int, ...], enforced: bool
    ) -> _PeerRule:
        """One inbound rule's output-chain lines for these families and mode, their sets and its index
        entry (None: no line), kept in `kept`."""
        texts: list[str] = []
        sets: dict[str, str] = {}
        for peer in self._rule_peer_lines(order, families):
            text, more = self._peer_line(peer, enforced)
            if text:
                texts.append(text)
                sets.update(more)
        rule = self._peer_index()[0][order][0]
        found = kept[order] = _PeerRule(
            rule.action == "deny",
            "".join(texts),
            tuple(sets.items()),
            (rule.number, self._entries[id(rule)]) if texts else None,
        )
        return found

    def _peer_line(self, peer: PeerLine, enforced: bool) -> tuple[str, tuple[tuple[str, str], ...]]:
        destination = self.selector_sets(peer.scope)
        if not destination.has[peer.family]:
            return "", ()
        line_sets = [self.destination_set(peer.scope, peer.family)]
        if peer.line.uses_service_set and peer.compiled.service_set is not None:
            service_name, service_definition = peer.compiled.service_set
            line_sets.append(
                (service_name, _claimed(self.fleet, service_name, service_definition, service_definition))
            )
        rule = peer.rule
        daddr = "ip daddr" if peer.family == 4 else "ip6 daddr"
        head = f"\t\t{daddr} @{line_sets[0][0]} {peer.line.tail} ct mark set "
        comment = peer.compiled.comment
        if rule.action != "deny":
            mark = encode_mark(DECISION_ALLOWED, rule.number, DIRECTION_OUTBOUND_FLAG)
            return f"{head}{mark:#010x} accept{comment}\n", tuple(line_sets)
        if enforced:
            mark = encode_mark(DECISION_BLOCKED, rule.number, DIRECTION_OUTBOUND_FLAG)
            prefix = deny_log_prefix(rule.number, outbound=True)
            verdict = f'log prefix "{prefix}" group {NFLOG_GROUP_BLOCKED} queue-threshold 1 drop'
        else:
            mark = encode_mark(DECISION_WOULD_BLOCK, rule.number, DIRECTION_OUTBOUND_FLAG)
            verdict = f"log group {NFLOG_GROUP_WOULD_BLOCK} queue-threshold 1 accept"
        return f"{head}{mark:#010x} {verdict}{comment}\n", tuple(line_sets)

    def _block(self, compiled: CompiledRuleset) -> _Block:
        """A ruleset's chain lines, their sets, and its rules' (number, rule-index entry): the same for
        every workload it applies to."""
        found = self._blocks.get(compiled)
        if found is not None:
            return found
        ruleset = compiled.ruleset
        flags = DIRECTION_OUTBOUND_FLAG if ruleset.direction == "outbound" else 0
        lines: list[str] = []
        simulation: list[str] = []
        enforced: list[str] = []
        sets: dict[str, str] = {}
        entries = []
        for rule, rule_compiled in compiled.rules:
            if not 0 < rule.number <= MAX_RULES:
                raise ValueError(f"rule {rule.id} has no lifetime number (1-{MAX_RULES}): {rule.number!r}")
            heads, rule_sets = self._resolved(rule_compiled)
            entry = _rule_entry(ruleset, rule)
            if rule.action == "deny":
                # Logged like the terminal rule (the NFLOG prefix names the rule of a dropped packet,
                # which never becomes a conntrack entry), but marked with the deny rule's number.
                would_block = (
                    f"{encode_mark(DECISION_WOULD_BLOCK, rule.number, flags):#010x} "
                    f"log group {NFLOG_GROUP_WOULD_BLOCK} queue-threshold 1 accept{rule_compiled.comment}\n"
                )
                blocked = (
                    f"{encode_mark(DECISION_BLOCKED, rule.number, flags):#010x} "
                    f'log prefix "{deny_log_prefix(rule.number, outbound=bool(flags))}" '
                    f"group {NFLOG_GROUP_BLOCKED} queue-threshold 1 drop{rule_compiled.comment}\n"
                )
                simulation.extend(head + would_block for head in heads)
                enforced.extend(head + blocked for head in heads)
            else:
                tail = f"{encode_mark(DECISION_ALLOWED, rule.number, flags):#010x} accept{rule_compiled.comment}\n"
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


@dataclass(frozen=True)
class _PeerRule:
    deny: bool
    text: str
    sets: tuple[tuple[str, str], ...]
    entry: tuple[int, dict] | None  # None: no line (its scope has no address of the families)


def _interval_index(
    resolved: Sequence[tuple[SourceSets, object]], indices: Iterable[int], family: int
) -> tuple[list[int], list[tuple[int, ...]]]:
    """(first addresses, sources covering from there): the stretches of `family`'s address space on
    which the same interval sources (address groups) hold an address, found by one sweep."""
    events: dict[int, list[tuple[int, int]]] = {}
    for index in indices:
        for low, high in resolved[index][0].intervals.get(family, ()):
            events.setdefault(low, []).append((index, 1))
            events.setdefault(high + 1, []).append((index, -1))
    points: list[int] = []
    covering: list[tuple[int, ...]] = []
    active: dict[int, int] = {}
    for point in sorted(events):
        for index, step in events[point]:
            count = active.get(index, 0) + step
            if count:
                active[index] = count
            else:
                active.pop(index, None)
        points.append(point)
        covering.append(tuple(sorted(active)))
    return points, covering


FAILSAFE_SET = "failsafe"


def _rule_entry(ruleset: RulesetInput, rule: RuleInput) -> dict:
    entry = {
        "ruleset_id": ruleset.id,
        "ruleset_name": ruleset.name,
        "rule_id": rule.id,
        "position": rule.position,
    }
    if ruleset.direction == "outbound":
        entry["direction"] = "outbound"
    if rule.action == "deny":
        entry["action"] = "deny"
    return entry


def _index(rule_index: dict[int, dict], entries: Iterable[tuple[int, dict]]) -> None:
    for number, entry in entries:
        if number in rule_index and rule_index[number] != entry:
            raise ValueError(f"rule number {number} is given to two rules")
        rule_index[number] = dict(entry)


def compile_policy(
    rulesets: Sequence[RulesetInput],
    groups: Mapping[str, AddressGroupInput],
    fleet: FleetIndex,
    failsafe: Sequence[PortEntry] = DEFAULT_OUTBOUND_FAILSAFE,
) -> CompiledPolicy:
    """The policy compiled against `fleet`, once for the same ruleset and group objects: rendering every
    workload of a fleet, or classifying each of its flow keys, compiles its policy once. Kept in the
    fleet index by the identity of those objects; the compiled policy holds them, so that their ids
    cannot be taken by other objects while it is kept."""
    key = (
        "policy",
        tuple(map(id, rulesets)),
        tuple(groups),
        tuple(map(id, groups.values())),
        tuple(failsafe),
    )
    found = fleet.memo.get(key)
    if found is None:
        found = fleet.memo[key] = CompiledPolicy(rulesets, groups, fleet, failsafe)
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
                lines.append(Line(None, family, match, uses_service, l4proto, tail=match))
    else:
        sources: set[tuple[str, str]] = set()
        for s in rule.sources:
            if s.selector is not None:
                selectors[str(s.selector)] = s.selector
                sources.add(("sel", str(s.selector)))
            elif s.address_group_id is not None:
                sources.add(("grp", s.address_group_id))
        # An outbound ruleset's rules name destinations: the same sets, read by the packet's daddr.
        end = "daddr" if ruleset.direction == "outbound" else "saddr"
        for source in sorted(sources):
            base = _set_base(source)
            for family, match, uses_service, l4proto in matches:
                address = f"ip {end}" if family == 4 else f"ip6 {end}"
                lines.append(
                    Line(
                        source,
                        family,
                        f"{address} @{base}_v{family} {match}",
                        uses_service,
                        l4proto,
                        tail=match,
                    )
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
    # The members as integer spans, merged and cut into prefixes without network objects: a group of
    # the peers seen is thousands of hosts, and collapse_addresses sorted and merged them as objects
    # (most of judging a suggested draft). The same prefixes, in the same order: the fewest that hold
    # exactly the members' addresses, found per run of consecutive addresses.
    spans: dict[int, list[tuple[int, int]]] = {4: [], 6: []}
    for member in group.members:
        try:
            family, first, last = _member_span(member)
        except ValueError as error:
            raise ValueError(f"address group {group.name!r}: bad member {member!r}: {error}") from None
        spans[family].append((first, last))
    label = f"address group {group.name}"
    base = _set_base(("grp", group.id))
    found = {}
    intervals = {}
    for family in (4, 6):
        name = f"{base}_v{family}"
        blocks = [block for run in _merged_spans(spans[family]) for block in _prefix_blocks(*run, family)]
        elements = [_block_text(first, length, family) for first, _, length in blocks]
        definition = _set_definition(name, family, label, elements)
        found[family] = (name, _claimed(fleet, name, ("grp", group.id), definition))
        intervals[family] = tuple((first, last) for first, last, _ in blocks)
    return SourceSets(found, {4: bool(spans[4]), 6: bool(spans[6])}, intervals=intervals)


@functools.lru_cache(maxsize=1 << 16)
def _member_span(member: str) -> tuple[int, int, int]:
    """(family, first, last address) of a group member; kept, as a group's members are judged again
    by every read of a draft that holds it."""
    network = _host_or_network(member)
    if isinstance(network, ipaddress.IPv4Address | ipaddress.IPv6Address):
        return network.version, int(network), int(network)
    first = int(network.network_address)
    return network.version, first, first | ((1 << (network.max_prefixlen - network.prefixlen)) - 1)


def _merged_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans' union as sorted, disjoint runs (touching spans joined)."""
    runs: list[tuple[int, int]] = []
    for first, last in sorted(spans):
        if runs and first <= runs[-1][1] + 1:
            if last > runs[-1][1]:
                runs[-1] = (runs[-1][0], last)
        else:
            runs.append((first, last))
    return runs


def _prefix_blocks(first: int, last: int, family: int) -> list[tuple[int, int, int]]:
    """[first, last] as the fewest prefixes (first, last, prefix length), in order: at each step the
    largest block aligned at `first` that fits (as ipaddress.summarize_address_range)."""
    bits = 32 if family == 4 else 128
    blocks = []
    while first <= last:
        size = (first & -first) if first else 1 << bits
        while size > last - first + 1:
            size >>= 1
        blocks.append((first, first + size - 1, bits - size.bit_length() + 1))
        first += size
    return blocks


def _block_text(first: int, length: int, family: int) -> str:
    address = ipaddress.IPv4Address(first) if family == 4 else ipaddress.IPv6Address(first)
    return str(address) if length == (32 if family == 4 else 128) else f"{address}/{length}"


def _runs(values: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct integers as (first, last) runs of consecutive values."""
    runs: list[tuple[int, int]] = []
    for value in values:
        if runs and runs[-1][1] + 1 == value:
            runs[-1] = (runs[-1][0], value)
        else:
            runs.append((value, value))
    return runs


def _run_prefixes(runs: Iterable[tuple[int, int]], family: int) -> list[str]:
    """The runs of addresses as the fewest prefixes that hold exactly them (a lone address as itself)."""
    make = ipaddress.IPv4Address if family == 4 else ipaddress.IPv6Address
    found: list[str] = []
    for first, last in runs:
        if first == last:
            found.append(str(make(first)))
        else:
            found.extend(_network_text(n) for n in ipaddress.summarize_address_range(make(first), make(last)))
    return found


def _host_or_network(
    member: str,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address | ipaddress.IPv4Network | ipaddress.IPv6Network:
    if "/" not in member:
        try:
            return parse_host_address(member)
        except ValueError:
            pass  # parse_network says why
    return parse_network(member)


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


def _service_set(service_ranges: list[tuple[str, list[list[int]]]], name: str = "") -> tuple[str, str] | None:
    if not service_ranges:
        return None
    elements = []
    for protocol, merged in service_ranges:
        for low, high in merged:
            elements.append(f"{protocol} . {low}" if low == high else f"{protocol} . {low}-{high}")
    name = name or f"svc_{_short_hash(','.join(elements))}"
    definition = (
        f"\tset {name} {{\n\t\ttype inet_proto . inet_service\n\t\tflags interval\n"
        + _elements_text(elements)
        + "\t}\n\n"
    )
    return name, definition

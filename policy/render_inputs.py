"""The renderer's whole input: immutable values with no Django in sight.

The control plane loads its models into these once per render pass; the renderer, the
benchmark and the tests build them directly. They check shape only (which protocol, which
kind of source, which mode). Addresses are checked where they turn into nftables text:
in ``FleetIndex.build`` and in the renderer.

``FleetIndex`` answers "which addresses do the workloads matching this selector have?"
for a whole fleet. It indexes label key -> value -> workload positions once and evaluates
each requirement with set algebra, so a few thousand distinct selectors over 10,000
workloads cost milliseconds each at most instead of a scan per selector.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from policy.grammar import Selector

PROTOCOLS = ("tcp", "udp", "icmp", "icmpv6")
PORT_PROTOCOLS = ("tcp", "udp")
# Plain copies of policy.choices.SourceKind and fleet.choices.Mode: this module imports no Django.
SOURCE_KINDS = ("selector", "address_group", "any")
MODES = ("visibility", "simulation", "enforced")
ACTIONS = ("allow", "deny")  # policy.choices.RuleAction
DIRECTIONS = ("inbound", "outbound")  # policy.choices.Direction


class FrozenLabels(Mapping[str, str]):
    """A read-only, hashable label mapping (Selector.matches takes any Mapping)."""

    __slots__ = ("_data", "_items")

    def __init__(self, labels: Mapping[str, str] | Iterable[tuple[str, str]] = ()) -> None:
        data = dict(labels)
        self._data = data
        self._items = tuple(sorted(data.items()))

    def __getitem__(self, key: str) -> str:
        return self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def get(self, key: str, default: Any = None) -> Any:
        return self._data.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenLabels):
            return self._items == other._items
        if isinstance(other, Mapping):
            return self._data == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenLabels({dict(self._items)!r})"


@dataclass(frozen=True)
class PortEntry:
    protocol: str
    port_from: int | None = None
    port_to: int | None = None

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {self.protocol!r}")
        ports = (self.port_from, self.port_to)
        if self.protocol in PORT_PROTOCOLS:
            if self.port_from is None:
                raise ValueError(f"{self.protocol} entries need a port or a port range")
            if self.port_to is None:
                object.__setattr__(self, "port_to", self.port_from)
            for port in (self.port_from, self.port_to):
                if type(port) is not int or not 0 <= port <= 65535:
                    raise ValueError(f"port {port!r} is not an integer in 0-65535")
            if self.port_from > self.port_to:  # type: ignore[operator]  # both set just above
                raise ValueError(f"port range {self.port_from}-{self.port_to} is reversed")
        elif ports != (None, None):
            raise ValueError(f"{self.protocol} entries take no ports")


@dataclass(frozen=True)
class SourceInput:
    kind: str
    selector: Selector | None = None
    address_group_id: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"unknown source kind {self.kind!r}")
        if (self.kind == "selector") != (self.selector is not None):
            raise ValueError("a selector source, and only it, carries a selector")
        if (self.kind == "address_group") != (self.address_group_id is not None):
            raise ValueError("an address_group source, and only it, carries an address_group_id")


def _freeze(obj: object, *names: str) -> None:
    for name in names:
        object.__setattr__(obj, name, tuple(getattr(obj, name)))


@dataclass(frozen=True)
class RuleInput:
    id: str
    position: int
    description: str
    sources: tuple[SourceInput, ...]
    entries: tuple[PortEntry, ...]  # named services' entries and inline entries, flattened
    # The rule's lifetime number (policy.models.Rule.number), carried in the ct mark: never reused,
    # so a connection admitted under any policy version still names this rule.
    number: int = 0
    # "deny": the rule refuses what it matches, before every allow rule of the workload's rulesets.
    action: str = "allow"

    def __post_init__(self) -> None:
        _freeze(self, "sources", "entries")
        if self.action not in ACTIONS:
            raise ValueError(f"unknown rule action {self.action!r}")


def covers_every_service(entries: Iterable[PortEntry]) -> bool:
    """Whether the entries admit every connection there is to admit: every tcp and udp port, icmp and
    icmpv6."""
    covered: dict[str, list[tuple[int, int]]] = {"tcp": [], "udp": []}
    protocols = set()
    for entry in entries:
        protocols.add(entry.protocol)
        if entry.protocol in covered:
            covered[entry.protocol].append((entry.port_from or 0, entry.port_to or 0))
    if not {"icmp", "icmpv6"} <= protocols:
        return False
    for ranges in covered.values():
        reached = 0  # every port up to here is covered
        for low, high in sorted(ranges):
            if low > reached + 1:
                break
            reached = max(reached, high)
        if reached < 65535:
            return False
    return True


def refuses_everything(rule: RuleInput) -> bool:
    """A deny rule from `any` source on every service: it refuses every new connection that the
    workloads of its scope receive (legal, but worth a warning wherever it is shown)."""
    return (
        rule.action == "deny"
        and any(s.kind == "any" for s in rule.sources)
        and covers_every_service(rule.entries)
    )


@dataclass(frozen=True)
class RulesetInput:
    id: str
    name: str
    scope: Selector
    rules: tuple[RuleInput, ...]
    # outbound: the scope's workloads open the connections; the rules' sources are their destinations.
    direction: str = "inbound"

    def __post_init__(self) -> None:
        _freeze(self, "rules")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"unknown ruleset direction {self.direction!r}")


@dataclass(frozen=True)
class AddressGroupInput:
    id: str
    name: str
    members: tuple[str, ...]  # CIDR text, e.g. "10.0.0.0/24", "10.0.0.5/32", "2001:db8::/64"

    def __post_init__(self) -> None:
        _freeze(self, "members")


@dataclass(frozen=True)
class WorkloadInput:
    id: str
    labels: FrozenLabels
    addresses: tuple[str, ...]
    mode: str
    # The mode judging the connections it opens; visibility (the default) renders no output chain.
    outbound_mode: str = "visibility"

    def __post_init__(self) -> None:
        if not isinstance(self.labels, FrozenLabels):
            object.__setattr__(self, "labels", FrozenLabels(self.labels))
        _freeze(self, "addresses")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}")
        if self.outbound_mode not in MODES:
            raise ValueError(f"unknown outbound mode {self.outbound_mode!r}")


# Kept: judging a range's flow keys parses each peer many times (the key, then each rule's check), and
# addresses are immutable values.
@functools.lru_cache(maxsize=1 << 16)
def parse_host_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """A plain IP that nftables will read as an address (never as a host name)."""
    address = ipaddress.ip_address(text)  # raises ValueError
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id is not None:
        raise ValueError(f"{text!r}: scoped IPv6 addresses cannot go into a firewall set")
    return address


def parse_network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A CIDR (or a plain IP) that nftables will read as a prefix."""
    network = ipaddress.ip_network(text, strict=False)  # raises ValueError
    if "%" in str(network):
        raise ValueError(f"{text!r}: scoped IPv6 addresses cannot go into a firewall set")
    return network


_EMPTY: frozenset[int] = frozenset()


@dataclass(eq=False)
class FleetIndex:
    """Every workload's labels and addresses, indexed for selector evaluation.

    Build one per render pass: ``memo`` is the renderer's, which keeps in it what it derives
    from this fleet (a selector's sets of peer addresses, the set names given out) and the
    policies compiled against it (``policy.renderer.compile_policy``).
    """

    workload_ids: tuple[str, ...]
    labels: tuple[FrozenLabels, ...]
    v4: tuple[tuple[int, ...], ...]  # addresses as integers, per workload position
    v6: tuple[tuple[int, ...], ...]
    _by_key: dict[str, dict[str, frozenset[int]]]
    _has_key: dict[str, frozenset[int]]
    _position: dict[str, int]
    _all: frozenset[int]
    _positions_memo: dict[str, frozenset[int]] = field(default_factory=dict)
    _values_memo: dict[str, tuple[frozenset[int], frozenset[int]]] = field(default_factory=dict)
    _strings_memo: dict[str, tuple[frozenset[str], frozenset[str]]] = field(default_factory=dict)
    memo: dict[Any, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, workloads: Iterable[WorkloadInput]) -> FleetIndex:
        ids, labels, v4, v6 = [], [], [], []
        by_key: dict[str, dict[str, set[int]]] = {}
        for position, workload in enumerate(workloads):
            ids.append(workload.id)
            labels.append(workload.labels)
            four: list[int] = []
            six: list[int] = []
            for text in workload.addresses:
                try:
                    address = parse_host_address(text)
                except ValueError as error:
                    raise ValueError(f"workload {workload.id}: bad address {text!r}: {error}") from None
                (four if address.version == 4 else six).append(int(address))
            v4.append(tuple(four))
            v6.append(tuple(six))
            for key, value in workload.labels.items():
                by_key.setdefault(key, {}).setdefault(value, set()).add(position)
        frozen = {k: {v: frozenset(p) for v, p in values.items()} for k, values in by_key.items()}
        has_key = {k: frozenset().union(*values.values()) for k, values in frozen.items()}
        return cls(
            workload_ids=tuple(ids),
            labels=tuple(labels),
            v4=tuple(v4),
            v6=tuple(v6),
            _by_key=frozen,
            _has_key=has_key,
            _position={wid: i for i, wid in enumerate(ids)},
            _all=frozenset(range(len(ids))),
        )

    def __len__(self) -> int:
        return len(self.workload_ids)

    def position_of(self, workload_id: str) -> int | None:
        return self._position.get(workload_id)

    def positions_matching(self, selector: Selector) -> frozenset[int]:
        text = str(selector)
        found = self._positions_memo.get(text)
        if found is None:
            found = self._all
            for requirement in selector.requirements:
                found = found & self._requirement_positions(requirement)
                if not found:
                    break
            self._positions_memo[text] = found
        return found

    def _requirement_positions(self, requirement: Any) -> frozenset[int]:
        # Every operator decides on one key's value only: by whether the value is one of the
        # listed values (and which), is some other value, or is missing. Asking
        # Requirement.matches about one representative of each case keeps the index exactly
        # as the grammar defines the operators, "!=" matching workloads without the key included.
        key = requirement.key
        values = self._by_key.get(key, {})
        with_key = self._has_key.get(key, _EMPTY)
        listed = [values.get(v, _EMPTY) for v in requirement.values]
        found: set[int] = set()
        for value, positions in zip(requirement.values, listed, strict=True):
            if positions and requirement.matches({key: value}):
                found |= positions
        if requirement.matches({key: "\x00unlisted"}):  # NUL is never in a label value
            found |= with_key.difference(*listed)
        if requirement.matches({}):
            found |= self._all - with_key
        return frozenset(found)

    def address_values_matching(self, selector: Selector) -> tuple[frozenset[int], frozenset[int]]:
        """The matching workloads' (IPv4, IPv6) addresses as integers."""
        text = str(selector)
        found = self._values_memo.get(text)
        if found is None:
            four: set[int] = set()
            six: set[int] = set()
            v4, v6 = self.v4, self.v6
            for position in self.positions_matching(selector):
                four.update(v4[position])
                six.update(v6[position])
            found = self._values_memo[text] = (frozenset(four), frozenset(six))
        return found

    def addresses_matching(self, selector: Selector) -> tuple[frozenset[str], frozenset[str]]:
        """The matching workloads' (IPv4, IPv6) addresses in their canonical text form."""
        text = str(selector)
        found = self._strings_memo.get(text)
        if found is None:
            four, six = self.address_values_matching(selector)
            found = self._strings_memo[text] = (
                frozenset(str(ipaddress.IPv4Address(a)) for a in four),
                frozenset(str(ipaddress.IPv6Address(a)) for a in six),
            )
        return found

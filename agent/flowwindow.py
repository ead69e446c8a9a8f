"""Flow windows: the connections a flow source saw, aggregated per wall-clock-aligned window.

A window aggregates by key (peer address, protocol, port, decision, rule number, direction and the
fail-safe marker) with the counters
of the spec's "Stored flow window":

- `connection_count`: connections opened in the window, or found live when the source subscribed
  (those once, first seen at the subscription): `connection_opened`.
- `first_seen` / `last_seen`: when the agent saw the key in the window.
- bytes in each direction: only when `net.netfilter.nf_conntrack_acct=1`; a connection's bytes are
  known when it ends (conntrack's DESTROY event), so they are counted in the window in which the
  connection ended, which is often a later one than the window that counted it (`bytes_counted`).
  A window says whether accounting was on, so "no bytes" and "not counted" differ.

At `max_keys` distinct keys of one direction a window takes no new key of that direction one by one
until it closes (each direction has its own bound): the observations of any other key are summed into the window's aggregate key for their decision and direction (peer and protocol
`AGGREGATE`, port 0, no rule), so every connection is still counted, and the window reports a
`keys_aggregated` gap from the first such observation to its end, with how many keys and connections
were summed so (the control plane bounds keys the same way, and folds into the same keys).

Nothing here reads a socket or a clock: sources and the daemon pass instants in, so the semantics are
tested exactly.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

DECISIONS = ("observed", "allowed", "would_block", "blocked")
INBOUND, OUTBOUND = "inbound", "outbound"
# The aggregate key's peer and protocol: no address or protocol is written so (flows/choices.py keeps
# the control plane's copy; a test keeps them equal).
AGGREGATE = "*"
KEYS_AGGREGATED = "keys_aggregated"


class FlowKey(NamedTuple):
    """A tuple: built and hashed for every connection event, in C rather than in a dataclass's Python."""

    peer: str  # the remote address, as text: the originator inbound, the destination outbound
    protocol: str  # tcp, udp, icmp, icmpv6, or the protocol number as text
    port: int  # the service (destination) port, never an ephemeral one; 0 for protocols without ports
    decision: str  # one of DECISIONS
    rule: int | None  # the rule's lifetime number from the ct mark; None when no rule decided
    direction: str = INBOUND  # who originated the connection: a peer (inbound) or this workload
    failsafe: bool = False  # allowed by the fail-safe list (DNS, NTP) rather than a rule


@dataclass(slots=True)
class Counters:
    connection_count: int = 0
    first_seen: float = math.inf
    last_seen: float = -math.inf
    bytes_in: int = 0
    bytes_out: int = 0

    def seen(self, at: float) -> None:
        if at < self.first_seen:
            self.first_seen = at
        if at > self.last_seen:
            self.last_seen = at


@dataclass(frozen=True)
class Gap:
    kind: str
    source: str | None  # conntrack, nflog, or None when not one source's loss
    start: float
    end: float
    lost: dict = field(default_factory=dict)  # what was lost where known: events, keys, windows


@dataclass(frozen=True)
class ClosedWindow:
    id: str  # stable across re-sends: given when the window opened
    start: float
    end: float
    policy_version: str
    accounting: bool
    groups: tuple[tuple[FlowKey, Counters], ...]


class OpenWindow:
    def __init__(self, start: float, length: float, max_keys: int, *, accounting: bool):
        self.id = str(uuid.uuid4())
        self.start, self.end = start, start + length
        self.max_keys = max_keys
        self.accounting = accounting
        self.counters: dict[FlowKey, Counters] = {}
        # Keys counted one by one, per direction (the aggregate keys are not among them): each direction
        # has its own bound, so a host opening connections to thousands of destinations never pushes the
        # connections it receives into the aggregate.
        self.kept: dict[str, int] = {}
        self.overflow_at: float | None = None
        self.aggregated_connections = 0
        self.aggregated_keys: set[FlowKey] = set()

    def _entry(self, key: FlowKey, at: float) -> tuple[Counters, bool]:
        """The counters an observation of `key` goes to, and whether they are its aggregate key's."""
        entry = self.counters.get(key)
        if entry is not None:
            return entry, False
        kept = self.kept.get(key.direction, 0)
        if kept >= self.max_keys:
            if self.overflow_at is None:
                self.overflow_at = at
            self.aggregated_keys.add(key)
            aggregate = FlowKey(AGGREGATE, AGGREGATE, 0, key.decision, None, key.direction)
            entry = self.counters.get(aggregate)
            if entry is None:
                entry = self.counters[aggregate] = Counters()
            return entry, True
        self.kept[key.direction] = kept + 1
        entry = self.counters[key] = Counters()
        return entry, False

    def connection_opened(self, key: FlowKey, at: float) -> None:
        self.connections_opened((key,), at)

    def connections_opened(self, keys: Iterable[FlowKey], at: float) -> None:
        """A connection opened at `at` for each of `keys` (a source's batch of events, read at one
        instant). The loop is the source's per-event path: a known key costs one look-up."""
        counters, kept, bound = self.counters, self.kept, self.max_keys
        for key in keys:
            entry = counters.get(key)
            if entry is None:
                direction = key[5]
                if kept.get(direction, 0) < bound:  # a new key within its direction's bound (_entry)
                    kept[direction] = kept.get(direction, 0) + 1
                    entry = counters[key] = Counters(1, at, at)
                    continue
                entry, _ = self._entry(key, at)
                self.aggregated_connections += 1
            entry.connection_count += 1
            if at < entry.first_seen:
                entry.first_seen = at
            if at > entry.last_seen:
                entry.last_seen = at

    def bytes_counted(self, key: FlowKey, at: float, bytes_in: int, bytes_out: int) -> None:
        if not self.accounting:
            return
        entry, _ = self._entry(key, at)
        entry.bytes_in += bytes_in
        entry.bytes_out += bytes_out
        entry.seen(at)

    def bytes_not_counted(self) -> None:
        """A connection ended in this window without counters (accounting was off when it opened): the
        window's bytes would fall short, so it counts none and says so, rather than report a short total."""
        if not self.accounting:
            return
        self.accounting = False
        for key, counters in list(self.counters.items()):
            if counters.connection_count == 0:  # there only for bytes
                del self.counters[key]
                if key.peer != AGGREGATE:
                    self.kept[key.direction] -= 1
            else:
                counters.bytes_in = counters.bytes_out = 0

    def close(self, policy_version: str) -> tuple[ClosedWindow | None, Gap | None]:
        """The closed window (None when it saw nothing: no report for it), and its gap when keys over
        the bound were summed into its aggregate keys."""
        gap = None
        if self.overflow_at is not None:
            gap = Gap(
                KEYS_AGGREGATED,
                None,
                self.overflow_at,
                self.end,
                {"keys": len(self.aggregated_keys), "connections": self.aggregated_connections},
            )
        if not self.counters:
            return None, gap
        groups = tuple(sorted(self.counters.items(), key=lambda item: _sort_key(item[0])))
        return ClosedWindow(self.id, self.start, self.end, policy_version, self.accounting, groups), gap


def _sort_key(key: FlowKey) -> tuple:
    return (key.direction, key.peer, key.protocol, key.port, key.decision, key.rule or 0, key.failsafe)


def window_start(at: float, length: float) -> float:
    """Windows are aligned to the wall clock: [k * length, (k + 1) * length)."""
    return math.floor(at / length) * length


class Windows:
    """The open windows of one agent: observations go to the window of their instant; `close_due`
    closes every window that has ended. An observation for a window already closed (a late event)
    goes to the oldest open window instead, so it is counted once and never lost."""

    # Sources observe under `lock`, a batch of events at a time: a real lock where the windows are shared
    # between threads (agent/flowreporter.py), none where they are not.
    lock: contextlib.AbstractContextManager = contextlib.nullcontext()

    def __init__(self, *, length: float, max_keys: int, accounting: bool):
        if length <= 0 or max_keys <= 0:
            raise ValueError("window length and key bound must be positive")
        self.length, self.max_keys, self.accounting = length, max_keys, accounting
        self.open: dict[float, OpenWindow] = {}
        self.closed_until = -math.inf
        self._current: OpenWindow | None = None  # the open window of the latest observation

    def _window(self, at: float) -> OpenWindow:
        current = self._current  # where almost every observation goes: checked before any arithmetic
        if current is not None and current.start <= at < current.end:
            return current
        start = max(window_start(at, self.length), self.closed_until)
        start = window_start(start, self.length)
        window = self.open.get(start)
        if window is None:
            window = self.open[start] = OpenWindow(
                start, self.length, self.max_keys, accounting=self.accounting
            )
        if window.start <= at < window.end:
            self._current = window
        return window

    def connection_opened(self, key: FlowKey, at: float) -> None:
        self._window(at).connection_opened(key, at)

    def connections_opened(self, keys: Iterable[FlowKey], at: float) -> None:
        self._window(at).connections_opened(keys, at)

    def bytes_counted(self, key: FlowKey, at: float, bytes_in: int, bytes_out: int) -> None:
        self._window(at).bytes_counted(key, at, bytes_in, bytes_out)

    def bytes_not_counted(self, at: float) -> None:
        self._window(at).bytes_not_counted()

    def close_due(self, now: float, policy_version: str) -> tuple[list[ClosedWindow], list[Gap]]:
        """Close every window that ended at or before `now` (all of them at shutdown: pass math.inf)."""
        windows, gaps = [], []
        for start in sorted(self.open):
            window = self.open[start]
            if window.end > now:
                break
            del self.open[start]
            if window is self._current:
                self._current = None
            self.closed_until = max(self.closed_until, window.end)
            closed, gap = window.close(policy_version)
            if closed is not None:
                windows.append(closed)
            if gap is not None:
                gaps.append(gap)
        return windows, gaps

    def open_keys(self) -> int:
        return sum(len(window.counters) for window in self.open.values())

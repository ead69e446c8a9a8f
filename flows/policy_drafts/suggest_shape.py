"""The shape of a suggested rule: its services as port entries (runs of ports as ranges) and its parts
cut to the limits of a ruleset write (policy/validation.py), so that every proposal is a body that
`POST /rulesets` accepts as it is; and the breadth of a rule, what it admits against what was seen.
Pure: no database."""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from policy.validation import MAX_GROUP_MEMBERS, MAX_SERVICES_PER_RULE, MAX_SOURCES_PER_RULE

# A run of ports with gaps becomes one range when at least this share of its ports was seen: a job's
# range (7000-7099) seen on 95 of its ports is one entry, not 95, and the unseen five are said.
DENSE = 0.8
# Runs with gaps are joined only past this many seen ports: 22 and 24 stay two services (admitting 23
# too is worth it only for a run of many ports). Contiguous ports are a range whatever their number.
RUN_AT_LEAST = 4
# A proposal that admits more than this many times the combinations seen carries a warning.
WIDER_THAN_SEEN = 2


@dataclass(frozen=True)
class PortRun:
    """One entry of a rule's services: a single port, a protocol without ports, or a range."""

    protocol: str
    low: int | None
    high: int | None
    seen: int  # how many of its ports (1 for a protocol without ports) the evidence holds

    @property
    def width(self) -> int:
        return 1 if self.low is None or self.high is None else self.high - self.low + 1

    def entry(self) -> dict:
        if self.low is None:
            return {"protocol": self.protocol}
        if self.high == self.low:
            return {"protocol": self.protocol, "port": self.low}
        return {"protocol": self.protocol, "port": self.low, "port_to": self.high}

    def holds(self, protocol: str, port: int) -> bool:
        if protocol != self.protocol:
            return False
        return self.low is None or (self.low <= port <= self.high)  # type: ignore[operator]


def port_runs(services: Iterable[tuple[str, int]]) -> list[PortRun]:
    """The entries for the services seen ((protocol, port) pairs): contiguous ports of a protocol as
    one range, and runs with gaps too when at least DENSE of their ports were seen."""
    ports: dict[str, set[int]] = defaultdict(set)
    runs: list[PortRun] = []
    for protocol, port in services:
        if protocol in ("tcp", "udp"):
            ports[protocol].add(port)
        elif not any(r.protocol == protocol for r in runs):
            runs.append(PortRun(protocol, None, None, 1))
    for protocol in sorted(ports):
        runs.extend(_runs_of(protocol, sorted(ports[protocol])))
    return sorted(runs, key=lambda r: (r.protocol, r.low or 0))


def _runs_of(protocol: str, ordered: list[int]) -> list[PortRun]:
    # Contiguous runs first, then neighbours joined while the joined run stays dense.
    runs: list[list[int]] = []
    for port in ordered:
        if runs and port == runs[-1][-1] + 1:
            runs[-1].append(port)
        else:
            runs.append([port])
    joined: list[list[int]] = []
    for run in runs:
        if joined:
            merged = joined[-1] + run
            if len(merged) >= RUN_AT_LEAST and len(merged) >= DENSE * (merged[-1] - merged[0] + 1):
                joined[-1] = merged
                continue
        joined.append(run)
    out = []
    for run in joined:
        if len(run) > 1:
            out.append(PortRun(protocol, run[0], run[-1], len(run)))
        else:
            out.extend(PortRun(protocol, port, port, 1) for port in run)
    return out


def chunks(items: Sequence, size: int) -> list[Sequence]:
    return [items[first : first + size] for first in range(0, len(items), size)] or [items]


def service_chunks(runs: list[PortRun]) -> list[list[PortRun]]:
    """The runs cut into rules' worth of services (a rule holds at most MAX_SERVICES_PER_RULE)."""
    return [list(c) for c in chunks(runs, MAX_SERVICES_PER_RULE)]


def member_chunks(members: list[str]) -> list[list[str]]:
    """Members cut into groups' worth (an address group holds at most MAX_GROUP_MEMBERS)."""
    return [list(c) for c in chunks(members, MAX_GROUP_MEMBERS)]


def source_chunks(sources: list[dict]) -> list[list[dict]]:
    return [list(c) for c in chunks(sources, MAX_SOURCES_PER_RULE)]


def addresses_admitted(members: Iterable[str]) -> int:
    # A member without a prefix is one address: most are, and parsing each is the cost.
    return sum(ipaddress.ip_network(m).num_addresses if "/" in m else 1 for m in members)


def breadth(*, workloads: int, peers: int, services: int, seen: int) -> dict:
    """A rule's breadth: the (workload, peer, service) combinations it admits (workloads its scope
    matches now x peers its sources admit x ports of its services) against the combinations seen."""
    admitted = workloads * peers * services
    ratio = round(admitted / seen, 2) if seen else None
    wider = seen > 0 and admitted > WIDER_THAN_SEEN * seen
    return {"admitted": admitted, "seen": seen, "ratio": ratio, "wider_than_seen": wider}

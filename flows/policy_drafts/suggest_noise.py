"""Keys that look like noise rather than policy, set apart from a suggestion with the reason: a
scanner (one peer, many ports, a connection or two on each), a connection to an ephemeral local port
(a late reply to a connection the workload opened, not a service it offers), a label value that
differs from a far commoner one of the same key only in case or by one character (a typo: `app=Web`
beside `app=web`), and the peers the operator asked to exclude. Pure: no database.

Each kind can be included on request (`include_noise`), except the operator's own exclusions.

Outbound keys (the workload opened the connection; the peer is the destination, the port the
destination's) are judged by the same kinds, turned round: a scanner is the workload itself opening
connections to many ports of one destination, a connection or two on each (a port scan from the host,
or a compromised one probing); an ephemeral port is the destination's, taking a connection or two from
the fleet (a late reply of the workload to a connection the destination opened, which conntrack no
longer tracked: seen as a new outgoing one). A workload reaching one port of many destinations is
not set apart: that is what a monitoring or backup job does."""

from __future__ import annotations

import ipaddress
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping

SCANNER = "scanner"
EPHEMERAL_PORT = "ephemeral-port"
LOOKALIKE_LABEL = "lookalike-label"
EXCLUDED_PEER = "excluded-peer"
KINDS = (SCANNER, EPHEMERAL_PORT, LOOKALIKE_LABEL)

# A peer is scanner-like on this many distinct ports or more, each seen on at most FEW connections.
SCANNER_PORTS = 16
FEW = 2
# Linux's default ip_local_port_range: where a workload's own outgoing connections get their port.
EPHEMERAL_LOW, EPHEMERAL_HIGH = 32768, 60999
# A listener on an ephemeral port is a service when it takes more connections than a stray reply.
EPHEMERAL_FEW = 3
# A value is a lookalike when its lookalike is held by at least this many times as many workloads.
LOOKALIKE_RARER = 3


def _one_apart(a: str, b: str) -> bool:
    """Whether one edit (substitution, insertion, deletion) turns a into b; two digits told apart are
    not a typo (`web1`, `web2`; `eu-1`, `eu-2`)."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
        return len(diff) == 1 and not (diff[0][0].isdigit() and diff[0][1].isdigit())
    short, long = (a, b) if len(a) < len(b) else (b, a)
    for i in range(len(long)):
        if long[:i] + long[i + 1 :] == short:
            return True
    return False


def lookalike_values(labels: Iterable[Mapping[str, str]], keys: Iterable[str]) -> dict[tuple[str, str], str]:
    """(key, value) -> why it looks like a typo of a commoner value of the same key, over the fleet's
    labels, for the label keys that make selectors."""
    counts: dict[str, Counter] = defaultdict(Counter)
    wanted = set(keys)
    for held in labels:
        for key, value in held.items():
            if key in wanted:
                counts[key][value] += 1
    found: dict[tuple[str, str], str] = {}
    for key, values in counts.items():
        for rare, n in values.items():
            for common, m in values.items():
                if m < LOOKALIKE_RARER * n or m <= n:
                    continue
                if rare.lower() == common.lower():
                    how = "differs only in case"
                elif len(rare) >= 3 and _one_apart(rare, common):
                    how = "differs by one character"
                else:
                    continue
                found[(key, rare)] = (
                    f"{key}={rare} looks like {key}={common} ({how}; {n} workload(s) against {m})"
                )
                break
    return found


def excluded_networks(texts: Iterable[str]) -> list:
    return [ipaddress.ip_network(t, strict=False) for t in texts]


class NoiseJudge:
    """For each unadmitted key of a range: the kind of noise it is and why, or None."""

    def __init__(
        self,
        rows: list[dict],
        *,
        lookalikes: Mapping[tuple[str, str], str],
        excluded: list,
        label_keys: list[str],
        direction: str = "inbound",
    ) -> None:
        self.lookalikes, self.excluded, self.label_keys = lookalikes, excluded, label_keys
        self.outbound = direction == "outbound"
        ports_of_peer: dict = defaultdict(set)
        self.on_port: Counter = Counter()
        for row in rows:
            count, protocol, port = row["connection_count"], row["protocol"], row["port"]
            if count <= FEW:
                ports_of_peer[self._scanner_key(row)].add((protocol, port))
            # Counted only where `judge` reads it: a fleet's keys are mostly on service ports.
            if protocol in ("tcp", "udp") and EPHEMERAL_LOW <= port <= EPHEMERAL_HIGH:
                self.on_port[self._port_key(row)] += count
        self.scanners = {p: len(s) for p, s in ports_of_peer.items() if len(s) >= SCANNER_PORTS}

    def _scanner_key(self, row: dict):
        """Who scans: the peer (inbound), or the workload, of one destination (outbound)."""
        return (row["workload_id"], row["peer"]) if self.outbound else row["peer"]

    def _port_key(self, row: dict) -> tuple:
        """Whose port: the workload's own (inbound), or the destination's (outbound)."""
        return (row["peer"] if self.outbound else row["workload_id"], row["protocol"], row["port"])

    def _excluded(self, peer: str) -> bool:
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(address.version == n.version and address in n for n in self.excluded)

    def _lookalike(self, labels: Mapping[str, str] | None) -> str | None:
        if not self.lookalikes or labels is None:
            return None
        for key in self.label_keys:
            if key in labels:
                why = self.lookalikes.get((key, labels[key]))
                if why:
                    return why
        return None

    def judge(self, row: dict, labels, peer_labels) -> tuple[str, str] | None:
        if self.excluded and self._excluded(row["peer"]):
            return EXCLUDED_PEER, "the peer is in exclude_peers"
        scanner = self._scanner_key(row)
        if scanner in self.scanners and row["connection_count"] <= FEW:
            if self.outbound:
                return SCANNER, (
                    f"scanner-like: the workload opened connections to {self.scanners[scanner]} ports of "
                    f"{row['peer']} with at most {FEW} connections each"
                )
            return SCANNER, (
                f"scanner-like peer: {self.scanners[scanner]} ports with at most {FEW} connections each"
            )
        port = row["port"]
        if row["protocol"] in ("tcp", "udp") and EPHEMERAL_LOW <= port <= EPHEMERAL_HIGH:
            if self.on_port[self._port_key(row)] <= EPHEMERAL_FEW:
                if self.outbound:
                    return EPHEMERAL_PORT, (
                        f"a connection to an ephemeral port of the destination ({row['protocol']}/{port}): "
                        "a late reply to a connection it opened, not a service"
                    )
                return EPHEMERAL_PORT, (
                    f"a connection to an ephemeral local port ({row['protocol']}/{port}): a late reply, "
                    "not a service"
                )
        why = self._lookalike(labels) or self._lookalike(peer_labels)
        if why:
            return LOOKALIKE_LABEL, why
        return None

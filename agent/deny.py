"""Open connections that a new enforced table's deny rules refuse: ended once the table is in place.

The table's first rule accepts established traffic, so a deny rule alone judges only new connections;
a peer cut off by one would keep the sessions it has open. After an enforced table with deny rules is
applied, the agent removes the conntrack entries of the inbound connections (those Palisade's table
marked) that a deny rule matches: the peer's next packet finds no entry, is judged as new, meets the
deny rule and is dropped (and logged, naming the rule). Then it aborts the host's own sockets of those
connections (SOCK_DESTROY), so that the session ends at once for both ends instead of stalling, and so
that the host cannot carry it on by sending first (conntrack would pick that up as the host's own
outbound connection, whose replies the baseline accepts).

The deny rules are read from the document itself, the control plane's rendering (policy/renderer.py):
each deny line is ``[ip|ip6 saddr @SET] (meta l4proto . th dport @SERVICES | meta l4proto icmp |
meta l4proto ipv6-icmp) ct mark set ... log prefix "palisade:in:N" ... drop``, its sets defined in the
same document with their elements. The agent imports nothing of the control plane; tests/agent checks
the two against each other. Only TCP and UDP entries are removed: an ICMP echo is over in a moment.
"""

from __future__ import annotations

import bisect
import errno
import ipaddress
import re
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from agent import conntrack
from agent.netlink import NLA_F_NESTED, netlink_socket

_SET = re.compile(r"^\tset (\S+) \{\n\t\ttype ([^\n]+)\n(.*?)^\t\}$", re.MULTILINE | re.DOTALL)
_ELEMENTS = re.compile(r"elements = \{(.*?)\}", re.DOTALL)
_DENY = re.compile(r'^\t\t(?P<match>.*?) ct mark set \S+ log prefix "palisade:in:(?P<rule>\d+)" .*\bdrop\b')
_SOURCE = re.compile(r"^(?P<family>ip6?) saddr @(?P<set>\S+) ")
_SERVICES = re.compile(r"meta l4proto \. th dport @(?P<set>\S+)$")
_PROTOCOLS = {"tcp": 6, "udp": 17}
OUTPUT_CHAIN = "\tchain output {"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class DenyLine:
    rule: int
    family: int | None  # 4 or 6; None: any source address
    intervals: tuple[tuple[int, int], ...]  # the source set's addresses as sorted (first, last) integers
    services: tuple[tuple[int, int, int], ...]  # (protocol number, first port, last port)

    def serves(self, protocol: int, port: int) -> bool:
        return any(p == protocol and low <= port <= high for p, low, high in self.services)

    def holds(self, family: int, address: int) -> bool:
        if self.family is None:
            return True
        if family != self.family:
            return False
        at = bisect.bisect_right(self.intervals, (address, _NO_ADDRESS)) - 1
        return at >= 0 and self.intervals[at][0] <= address <= self.intervals[at][1]

    def matches(self, peer: str, protocol: int, port: int) -> bool:
        address = ipaddress.ip_address(peer)
        return self.serves(protocol, port) and self.holds(address.version, int(address))


_NO_ADDRESS = 1 << 128  # above every address: bisects to the last interval starting at or below one


def _elements(body: str) -> list[str]:
    found = _ELEMENTS.search(body)
    return [e.strip() for e in found.group(1).split(",") if e.strip()] if found else []


def _intervals(elements: list[str]) -> tuple[tuple[int, int], ...]:
    networks = sorted(ipaddress.ip_network(e, strict=False) for e in elements)
    return tuple((int(n.network_address), int(n.broadcast_address)) for n in networks)


def deny_lines(document: str) -> list[DenyLine]:
    """The document's deny lines that judge ported connections, in chain order."""
    sets = {name: (kind, _elements(body)) for name, kind, body in _SET.findall(document)}
    lines = []
    # The output chain's deny lines judge the connections the workload opens: they end nothing here.
    inbound, _, _ = document.partition(OUTPUT_CHAIN)
    for text in inbound.splitlines():
        found = _DENY.match(text)
        if found is None:
            continue
        match = found["match"]
        services = _SERVICES.search(match)
        if services is None:
            continue  # an ICMP line
        ranges = []
        for element in sets.get(services["set"], ("", []))[1]:
            protocol, _, ports = element.partition(" . ")
            low, _, high = ports.partition("-")
            ranges.append((_PROTOCOLS[protocol], int(low), int(high or low)))
        source = _SOURCE.match(match)
        family, intervals = None, ()
        if source is not None:
            family = 6 if source["family"] == "ip6" else 4
            intervals = _intervals(sets.get(source["set"], ("", []))[1])
        lines.append(DenyLine(int(found["rule"]), family, intervals, tuple(ranges)))
    return lines


def denied(entries: Iterable[conntrack.Entry], lines: list[DenyLine]) -> list[conntrack.Entry]:
    """The inbound connections (marked by Palisade's table) that a deny line matches. A host listens
    on few ports: the lines that serve each (protocol, port) are found once, then only their sets are
    asked about each peer."""
    if not lines:
        return []
    serving: dict[tuple[int, int], list[DenyLine]] = {}
    found = []
    for entry in entries:
        if entry.protocol not in conntrack.PORTED:
            continue
        decision, _, direction, _ = conntrack.decode_mark_flags(entry.mark)
        # One the workload opened (outbound flag) is not judged by its inbound deny rules: its port is
        # the remote service's, and its source the workload's own address.
        if decision is None or direction != conntrack.INBOUND:
            continue
        service = (entry.protocol, entry.destination_port)
        candidates = serving.get(service)
        if candidates is None:
            candidates = serving[service] = [line for line in lines if line.serves(*service)]
        if not candidates:
            continue
        address = ipaddress.ip_address(entry.source)
        if any(line.holds(address.version, int(address)) for line in candidates):
            found.append(entry)
    return found


def _attribute(kind: int, value: bytes) -> bytes:
    return struct.pack("=HH", 4 + len(value), kind) + value + b"\0" * (-len(value) % 4)


def _delete_message(entry: conntrack.Entry, sequence: int) -> bytes:
    source, destination = ipaddress.ip_address(entry.source), ipaddress.ip_address(entry.destination)
    family = socket.AF_INET6 if source.version == 6 else socket.AF_INET
    src_kind, dst_kind = (
        (conntrack.CTA_IP_V6_SRC, conntrack.CTA_IP_V6_DST)
        if source.version == 6
        else (conntrack.CTA_IP_V4_SRC, conntrack.CTA_IP_V4_DST)
    )
    ip = _attribute(src_kind, source.packed) + _attribute(dst_kind, destination.packed)
    proto = (
        _attribute(conntrack.CTA_PROTO_NUM, bytes([entry.protocol]))
        + _attribute(conntrack.CTA_PROTO_SRC_PORT, struct.pack(">H", entry.source_port))
        + _attribute(conntrack.CTA_PROTO_DST_PORT, struct.pack(">H", entry.destination_port))
    )
    tuple_orig = _attribute(conntrack.CTA_TUPLE_IP | NLA_F_NESTED, ip) + _attribute(
        conntrack.CTA_TUPLE_PROTO | NLA_F_NESTED, proto
    )
    body = (
        struct.pack("=BBH", family, 0, 0)
        + _attribute(conntrack.CTA_TUPLE_ORIG | NLA_F_NESTED, tuple_orig)
        # The id too: a connection reusing the tuple since the dump is not this one.
        + _attribute(conntrack.CTA_ID, struct.pack(">I", entry.id))
    )
    message_type = (conntrack.NFNL_SUBSYS_CTNETLINK << 8) | conntrack.IPCTNL_MSG_CT_DELETE
    return (
        struct.pack("=IHHII", 16 + len(body), message_type, conntrack.NLM_F_REQUEST | 0x4, sequence, 0) + body
    )


def delete(entries: list[conntrack.Entry]) -> int:
    """Remove the entries; how many were removed (one that ended meanwhile is not counted)."""
    removed = 0
    with netlink_socket(0, 1 << 20) as sock:
        for sequence, entry in enumerate(entries, start=1):
            sock.send(_delete_message(entry, sequence))
            answer = sock.recv(65536)
            code = -struct.unpack_from("=i", answer, 16)[0] if len(answer) >= 20 else 0
            if code == 0:
                removed += 1
            elif code != errno.ENOENT:
                raise OSError(code, f"removing a conntrack entry: {errno.errorcode.get(code, code)}")
    return removed


# sock_diag (linux/sock_diag.h, linux/inet_diag.h): SOCK_DESTROY aborts a local socket as `ss -K` does.
NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, SOCK_DESTROY = 4, 20, 21
_NO_COOKIE = (0xFFFFFFFF, 0xFFFFFFFF)
_MAPPED = bytes(10) + b"\xff\xff"  # ::ffff:a.b.c.d, how a dual-stack listener's socket holds an IPv4 peer
TCP_LISTEN = 10
_DIAG_MSG = struct.Struct(">BBBBHH16s16s")  # family, state, timer, retrans; sport, dport, src, dst
_COOKIE = struct.Struct("=II")


def _diag_message(kind: int, family: int, protocol: int, tuple_: tuple, cookie: tuple[int, int]) -> bytes:
    local, port, peer, peer_port = tuple_
    sockid = struct.pack(">HH", port, peer_port) + local.ljust(16, b"\0") + peer.ljust(16, b"\0")
    sockid += struct.pack("=I", 0) + _COOKIE.pack(*cookie)
    body = struct.pack("=BBBxI", family, protocol, 0, 0xFFFFFFFF) + sockid
    return (
        struct.pack("=IHHII", 16 + len(body), kind, 0x1 | (0x4 if kind == SOCK_DESTROY else 0), 1, 0) + body
    )


def _connected_cookie(
    sock: socket.socket, family: int, protocol: int, tuple_: tuple
) -> tuple[int, int] | None:
    """The cookie of the local socket of exactly this connection. The kernel's lookup falls back to a
    listening (or unconnected UDP) socket of the port when the connection's own is gone: that one is
    never the connection's, and is left alone."""
    sock.send(_diag_message(SOCK_DIAG_BY_FAMILY, family, protocol, tuple_, _NO_COOKIE))
    answer = sock.recv(65536)
    if (
        len(answer) < 16 + _DIAG_MSG.size + 12
        or struct.unpack_from("=H", answer, 4)[0] != SOCK_DIAG_BY_FAMILY
    ):
        return None
    _, state, _, _, port, peer_port, src, dst = _DIAG_MSG.unpack_from(answer, 16)
    local, want_port, peer, want_peer_port = tuple_
    if state == TCP_LISTEN or (port, peer_port) != (want_port, want_peer_port):
        return None
    if src[: len(local)] != local or dst[: len(peer)] != peer:
        return None
    return _COOKIE.unpack_from(answer, 16 + _DIAG_MSG.size + 4)


def abort_sockets(entries: list[conntrack.Entry]) -> None:
    """Abort this host's sockets of the connections: the application sees the connection reset and the
    peer gets a reset, so the session ends at once rather than stalling. Best effort: a kernel without
    SOCK_DESTROY (CONFIG_INET_DIAG_DESTROY), or a socket gone meanwhile, leaves the removed entries to
    do the work. Only the socket found by its exact tuple is aborted, by its cookie."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    except OSError:
        return
    with sock:
        sock.settimeout(2)
        for entry in entries:
            peer, local = ipaddress.ip_address(entry.source), ipaddress.ip_address(entry.destination)
            tries = [(socket.AF_INET6 if peer.version == 6 else socket.AF_INET, local.packed, peer.packed)]
            if peer.version == 4:
                tries.append((socket.AF_INET6, _MAPPED + local.packed, _MAPPED + peer.packed))
            for family, local_bytes, peer_bytes in tries:
                tuple_ = (local_bytes, entry.destination_port, peer_bytes, entry.source_port)
                try:
                    cookie = _connected_cookie(sock, family, entry.protocol, tuple_)
                    if cookie is None:
                        continue
                    sock.send(_diag_message(SOCK_DESTROY, family, entry.protocol, tuple_, cookie))
                    sock.recv(65536)
                except OSError:
                    return
                break


def end_denied_connections(document: str) -> int:
    """After `document` (an enforced table) is applied: end the open connections its deny rules refuse;
    how many were ended (their conntrack entries removed)."""
    lines = deny_lines(document)
    if not lines:
        return 0
    entries, _ = conntrack.dump()
    refused = denied(entries, lines)
    removed = delete(refused)
    abort_sockets(refused)
    return removed

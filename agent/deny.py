"""Open connections that a new enforced table's deny rules refuse: ended once the table is in place.

The table's first rule accepts established traffic, so a deny rule alone judges only new connections;
a peer cut off by one would keep the sessions it has open. After an enforced table with deny rules is
applied, the agent removes the conntrack entries of the inbound connections (those Palisade's table
marked) that a deny rule matches: the peer's next packet finds no entry, is judged as new, meets the
deny rule and is dropped (and logged, naming the rule).

The deny rules are read from the document itself, the control plane's rendering (policy/renderer.py):
each deny line is ``[ip|ip6 saddr @SET] (meta l4proto . th dport @SERVICES | meta l4proto icmp |
meta l4proto ipv6-icmp) ct mark set ... log prefix "palisade deny N" ... drop``, its sets defined in the
same document with their elements. The agent imports nothing of the control plane; tests/agent checks
the two against each other. Only TCP and UDP entries are removed: an ICMP echo is over in a moment.
"""

from __future__ import annotations

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
_DENY = re.compile(r'^\t\t(?P<match>.*?) ct mark set \S+ log prefix "palisade deny (?P<rule>\d+)" .*\bdrop\b')
_SOURCE = re.compile(r"^(?P<family>ip6?) saddr @(?P<set>\S+) ")
_SERVICES = re.compile(r"meta l4proto \. th dport @(?P<set>\S+)$")
_PROTOCOLS = {"tcp": 6, "udp": 17}
OUTPUT_CHAIN = "\tchain output {"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class DenyLine:
    rule: int
    family: int | None  # 4 or 6; None: any source address
    networks: tuple[Network, ...]
    services: tuple[tuple[int, int, int], ...]  # (protocol number, first port, last port)

    def matches(self, peer: str, protocol: int, port: int) -> bool:
        address = ipaddress.ip_address(peer)
        if self.family is not None and (
            address.version != self.family or not any(address in n for n in self.networks)
        ):
            return False
        return any(p == protocol and low <= port <= high for p, low, high in self.services)


def _elements(body: str) -> list[str]:
    found = _ELEMENTS.search(body)
    return [e.strip() for e in found.group(1).split(",") if e.strip()] if found else []


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
        family, networks = None, ()
        if source is not None:
            family = 6 if source["family"] == "ip6" else 4
            networks = tuple(
                ipaddress.ip_network(e, strict=False) for e in sets.get(source["set"], ("", []))[1]
            )
        lines.append(DenyLine(int(found["rule"]), family, networks, tuple(ranges)))
    return lines


def denied(entries: Iterable[conntrack.Entry], lines: list[DenyLine]) -> list[conntrack.Entry]:
    """The inbound connections (marked by Palisade's table) that a deny line matches."""
    if not lines:
        return []
    return [
        entry
        for entry in entries
        if entry.protocol in conntrack.PORTED
        and conntrack.decode_mark(entry.mark)[0] is not None
        and any(line.matches(entry.source, entry.protocol, entry.destination_port) for line in lines)
    ]


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


def end_denied_connections(document: str) -> int:
    """After `document` (an enforced table) is applied: end the open connections its deny rules refuse;
    how many were ended."""
    lines = deny_lines(document)
    if not lines:
        return 0
    entries, _ = conntrack.dump()
    return delete(denied(entries, lines))

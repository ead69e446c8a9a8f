"""The control-plane addresses the agent puts into its table: never cut off by an outbound policy.

A document with an output chain (an outbound mode other than visibility) holds two empty sets,
``agent_gateways_v4`` and ``agent_gateways_v6`` (``address . tcp port``), that the chain accepts before
any rule, a deny rule included (policy/renderer.py, GATEWAY_SETS). The control plane cannot know
which address this agent reaches it by (a name, a proxy, a NAT), so the agent fills them itself each
time it applies a table, in the same text and so the same batch: the addresses its gateway names
resolve to now, and the address of the stream it is connected by. A stale document can therefore
never leave the agent's way back out; what it resolved last is kept when a lookup fails.

Standard library only: the agent imports nothing of the control plane (tests/agent checks the set
names against the renderer's).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

GATEWAY_SETS = {4: "agent_gateways_v4", 6: "agent_gateways_v6"}

Endpoint = tuple[str, int]  # (address, tcp port)


def split_gateway(gateway: str) -> tuple[str, int]:
    """HOST:PORT or [IPV6]:PORT (the enrolment bundle's form) as (host, port)."""
    host, _, port = gateway.rpartition(":")
    return host.strip("[]"), int(port)


def resolve(gateways: Iterable[str]) -> list[Endpoint]:
    """Every address the gateways' names resolve to now (blocking; an address resolves to itself)."""
    found: list[Endpoint] = []
    for gateway in gateways:
        host, port = split_gateway(gateway)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            continue
        found.extend((str(info[4][0]), port) for info in infos)
    return found


def with_gateways(document: str, endpoints: Iterable[Endpoint]) -> str:
    """`document` with the endpoints as the elements of its gateway sets (unchanged without them)."""
    elements: dict[int, set[str]] = {4: set(), 6: set()}
    for address, port in endpoints:
        try:
            parsed = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            continue
        if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
            parsed = parsed.ipv4_mapped
        elements[parsed.version].add(f"{parsed} . {port}")
    for family, name in GATEWAY_SETS.items():
        head = f"\tset {name} {{\n\t\ttype {'ipv4_addr' if family == 4 else 'ipv6_addr'} . inet_service\n"
        if head not in document or not elements[family]:
            continue
        document = document.replace(
            head, f"{head}\t\telements = {{ {', '.join(sorted(elements[family]))} }}\n", 1
        )
    return document

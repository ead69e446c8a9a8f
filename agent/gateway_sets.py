"""The control-plane addresses the agent puts into its table: never cut off by an outbound policy.

A document with an output chain (an outbound mode other than visibility) holds two empty sets,
``agent_gateways_v4`` and ``agent_gateways_v6`` (``address . tcp port``), that the chain accepts before
any rule, a deny rule included (policy/renderer.py, GATEWAY_SETS). The control plane cannot know
which address this agent reaches it by (a name, a proxy, a NAT), so the agent fills them itself each
time it applies a table, in the same text and so the same batch: the addresses its gateway names
resolve to now (every gateway it lists: the enrolment bundle's, or the last list the gateway pushed,
agent/state.py load_gateways), and the address of the stream it is connected by. A stale document can therefore
never leave the agent's way back out; what it resolved last is kept when a lookup fails.

Standard library only: the agent imports nothing of the control plane (tests/agent checks the set
names against the renderer's).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from agent import gateways
from agent.tls import split_gateway

GATEWAY_SETS = {4: "agent_gateways_v4", 6: "agent_gateways_v6"}

Endpoint = tuple[str, int]  # (address, tcp port)


def resolve(listed: Iterable[str]) -> list[Endpoint]:
    """Every address every listed gateway (HOST:PORT) resolves to now, each once (blocking; an address
    resolves to itself; a name that does not resolve is skipped)."""
    found: list[Endpoint] = []
    for gateway in listed:
        host, port = split_gateway(gateway)
        for address in gateways.resolve(host, port):
            if (address, port) not in found:
                found.append((address, port))
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

"""The control plane's gateways as the agent tries them: the ordered list from the enrolment bundle (or
the last one the gateway pushed), each HOST:PORT expanded to every address its name resolves to, so a
DNS name with several addresses counts as several gateways. Every gateway presents the one pinned
certificate, so the pin, not the name, says the agent reached its control plane.

The sync stream and the flow reports both try them in order and take the first that answers; the
stream, having lost its gateway, starts with the one after it (agent/daemon.py).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

from agent.tls import split_gateway

CONNECT_SECONDS = 3.0  # a gateway whose host is gone costs this much before the next is tried
# A gateway whose host vanishes without closing the stream (power cut, network partition) sends nothing
# more, and the websocket keepalive (a ping every 20 s, 20 s to answer) would take up to 40 s to say so.
# The kernel finds out sooner and at no cost to serve: after SILENT_PROBE_AFTER idle seconds it probes
# every second, and a connection that heard nothing (no data, no probe's answer, no acknowledgement of
# what was sent) for SILENT_SECONDS is closed. A heartbeat sent just before the silence is retransmitted
# meanwhile, so the stream is given up at most ~9 s after the host went silent, and the next gateway
# is tried at once.
SILENT_PROBE_AFTER = 3
SILENT_SECONDS = 6

Resolver = Callable[[str, int], list[str]]


@dataclass(frozen=True)
class Candidate:
    address: str  # the list entry, HOST:PORT or [IPV6]:PORT
    host: str  # the IP address to connect to (the name itself when it did not resolve)
    port: int

    @property
    def label(self) -> str:
        """The entry, and the address it resolved to when that is not the entry's host."""
        listed = split_gateway(self.address)[0]
        return self.address if listed == self.host else f"{self.address} ({self.host})"


def silence_bounded(sock: socket.socket) -> None:
    """Have the kernel close `sock` once its peer has been silent for about SILENT_SECONDS."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, SILENT_PROBE_AFTER)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, SILENT_SECONDS - SILENT_PROBE_AFTER)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, SILENT_SECONDS * 1000)


def _is_ip(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return True
        except OSError:
            continue
    return False


def resolve(host: str, port: int) -> list[str]:
    """Every address of `host` in the resolver's order, each once; [] when it does not resolve."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    addresses: list[str] = []
    for *_, sockaddr in found:
        address = str(sockaddr[0])
        if address not in addresses:
            addresses.append(address)
    return addresses


def needs_resolving(gateways: list[str]) -> bool:
    """Whether any entry names a host rather than an address (resolving blocks: off the event loop)."""
    return not all(_is_ip(split_gateway(address)[0]) for address in gateways)


def candidates(gateways: list[str], *, resolver: Resolver = resolve) -> list[Candidate]:
    """Every gateway to try, in order; a name that does not resolve stays, to fail (and be logged) when
    it is tried."""
    found: list[Candidate] = []
    for address in gateways:
        host, port = split_gateway(address)
        hosts = [host] if _is_ip(host) else (resolver(host, port) or [host])
        found.extend(Candidate(address, each, port) for each in hosts)
    return found


def rotated(found: list[Candidate], after: Candidate | None) -> list[Candidate]:
    """`found` starting with the one after `after` (the gateway just lost), wrapping around."""
    if after is None or after not in found:
        return found
    index = found.index(after) + 1
    return found[index:] + found[:index]

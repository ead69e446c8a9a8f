"""Where the sender may connect. A webhook's URL is checked when it is created, and again at every
delivery: its host name is resolved and every address it resolves to is checked before connecting to
one of them (the connection goes to the address checked, never to a second lookup), so a name that
later resolves to a refused address (DNS rebinding) fails at delivery.

- Never, whatever the scheme: unspecified, link-local, multicast, broadcast and reserved addresses,
  and the cloud metadata services (by address, and by their well-known names). An IPv6 address that
  carries an IPv4 one (IPv4-mapped, NAT64's 64:ff9b::/96, 6to4) is judged by that one as well.
- Loopback only on the ports listed in `PALISADE_WEBHOOK_LOOPBACK_PORTS` (a receiver on this host):
  other loopback ports are this host's own services, whose answers must not be probed through us.
- Plain http only to those loopback ports.
- Private ranges (RFC 1918, 100.64.0.0/10, fc00::/7) unless `PALISADE_WEBHOOK_PRIVATE_ADDRESSES` is
  `refuse`.
- A host written as a number in another form than dotted decimal (`2130706433`, `0177.0.0.1`,
  `127.1`) is refused as written: resolvers read those as addresses, people do not.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings

from controlplane.addresses import LOOPBACK, WHAT_IT_NAMES, IPAddress, kind_phrase, plain, special_use
from controlplane.validation import quoted

# Findings' rules (docs/api.md).
URL, URL_SCHEME, URL_ADDRESS, URL_LOOPBACK_PORT = "url", "url-scheme", "url-address", "url-loopback-port"

METADATA_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "169.254.169.254/32",  # AWS, GCP, Azure, OCI, DigitalOcean, OpenStack (link-local anyway)
        "fd00:ec2::/32",  # AWS's instance services over IPv6 (metadata fd00:ec2::254, DNS, time)
        "100.100.100.200/32",  # Alibaba Cloud
        "168.63.129.16/32",  # Azure's platform endpoint (WireServer)
        "192.0.0.192/32",  # Oracle Cloud's older metadata address
    )
)
METADATA_NAMES = frozenset(
    {
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "instance-data",
        "instance-data.ec2.internal",
        "metadata.tencentyun.com",
    }
)
PRIVATE_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7")
)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_SITE_LOCAL = ipaddress.IPv6Network("fec0::/10")  # deprecated, and link-scoped in practice
# A label that resolvers read as a number: decimal, octal (leading 0) or hexadecimal (0x).
_NUMERIC_LABEL = re.compile(r"(0x[0-9a-f]*|[0-9]+)", re.IGNORECASE)


class Refused(Exception):
    """A destination the sender must not reach: `rule` is the finding's, `reason` says why (ours)."""

    def __init__(self, rule: str, reason: str):
        super().__init__(reason)
        self.rule, self.reason = rule, reason


@dataclass(frozen=True)
class Destination:
    scheme: str
    host: str  # as in the URL, lower-case, IPv6 without brackets
    port: int

    @property
    def secure(self) -> bool:
        return self.scheme == "https"


def destination_of(url: str) -> Destination:
    """The scheme, host and port of a webhook URL; `Refused` when it is not an absolute http(s) URL
    with a host, or carries credentials, a fragment, spaces or control characters."""
    if any(ord(char) <= 0x20 or ord(char) == 0x7F for char in url):
        raise Refused(URL, "url must not contain spaces or control characters.")
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError:
        raise Refused(URL, f"url {quoted(url)} is not a URL.") from None
    if parts.scheme not in ("https", "http") or not host:
        raise Refused(URL, "url must be an absolute https:// URL with a host.")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise Refused(URL, "url must not carry credentials; the signature authenticates the sender.")
    if parts.fragment:
        raise Refused(URL, "url must not have a fragment.")
    # One trailing dot (a fully qualified name) names the same host: dropped, so that `127.0.0.1.` is
    # judged, and connected to, as the address it is.
    host = host[:-1] if host.endswith(".") else host
    return Destination(parts.scheme, host, port or (443 if parts.scheme == "https" else 80))


def literal_address(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def host_check(destination: Destination) -> None:
    """What the host refuses as written, before any lookup."""
    host = destination.host
    if host in METADATA_NAMES:
        raise Refused(URL_ADDRESS, f"{host} is a cloud metadata service; webhooks never reach one.")
    if literal_address(destination.host) is not None:
        return
    if ":" in host or "%" in host:
        raise Refused(
            URL, f"{quoted(destination.host)} is not an IP address (and no host name has ':' or '%')."
        )
    if all(_NUMERIC_LABEL.fullmatch(label) for label in host.split(".")):
        raise Refused(
            URL,
            f"{quoted(destination.host)} is a number, not a host name: write an IPv4 address in dotted "
            "decimal (a.b.c.d), an IPv6 address in brackets, or a name.",
        )


def loopback_ports() -> frozenset[int]:
    return frozenset(settings.PALISADE_WEBHOOK_LOOPBACK_PORTS)


def _carried(address: IPAddress) -> list[IPAddress]:
    """The address, and the IPv4 address an IPv6 one carries (mapped, NAT64, 6to4)."""
    address = plain(address)
    found = [address]
    if isinstance(address, ipaddress.IPv6Address):
        if address in _NAT64:
            found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        if address.sixtofour is not None:
            found.append(address.sixtofour)
    return found


def address_check(address: IPAddress, destination: Destination) -> None:
    """Refused (with why) when the sender must not connect to `address` for this destination."""
    written = literal_address(destination.host) is not None
    shown = str(address) if written else f"{destination.host} resolves to {address}"
    for candidate in _carried(address):
        kind = special_use(candidate)
        if kind == LOOPBACK and destination.port not in loopback_ports():
            raise Refused(
                URL_LOOPBACK_PORT,
                f"{shown}: loopback, on port {destination.port}, which PALISADE_WEBHOOK_LOOPBACK_PORTS does "
                "not list; a receiver on this host is admitted only on a port listed there.",
            )
        if kind not in (None, LOOPBACK):
            raise Refused(URL_ADDRESS, f"{shown}: {kind_phrase(kind)}, naming {WHAT_IT_NAMES[kind]}.")
        if any(candidate in network for network in METADATA_NETWORKS):
            raise Refused(URL_ADDRESS, f"{shown}: a cloud metadata service; webhooks never reach one.")
        # NAT64 addresses sit in a reserved range: they are judged by the IPv4 address they carry.
        if (candidate.is_reserved and candidate not in _NAT64 and kind is None) or candidate in _SITE_LOCAL:
            raise Refused(URL_ADDRESS, f"{shown}: a reserved address, routed nowhere.")
        if settings.PALISADE_WEBHOOK_PRIVATE_ADDRESSES == "refuse" and any(
            candidate in network for network in PRIVATE_NETWORKS
        ):
            raise Refused(
                URL_ADDRESS, f"{shown}: a private address, and PALISADE_WEBHOOK_PRIVATE_ADDRESSES is refuse."
            )
    if destination.scheme == "http" and special_use(plain(address)) != LOOPBACK:
        raise Refused(
            URL_SCHEME,
            "url must use https; plain http is admitted only to a loopback address, on a port listed in "
            "PALISADE_WEBHOOK_LOOPBACK_PORTS.",
        )


# Name lookups run here, so that one that hangs is abandoned at its deadline (getaddrinfo itself
# cannot be interrupted); a few threads, so that hung lookups cannot pile up without bound.
_resolver = ThreadPoolExecutor(max_workers=4, thread_name_prefix="webhook-resolve")

Resolved = list[tuple[Any, ...]]  # getaddrinfo's (family, type, proto, canonname, sockaddr)


def resolve(destination: Destination, *, deadline: float) -> Resolved:
    """getaddrinfo for a TCP connection to the destination, abandoned at `deadline` (monotonic):
    TimeoutError then, socket.gaierror when the name does not resolve."""
    pending = _resolver.submit(
        socket.getaddrinfo, destination.host, destination.port, type=socket.SOCK_STREAM
    )
    try:
        return pending.result(timeout=max(deadline - time.monotonic(), 0.001))
    except FutureTimeout:
        raise TimeoutError(f"no address for {destination.host} in time") from None


def resolved_check(destination: Destination, resolved: Resolved) -> None:
    """Every address the host resolved to must pass: one refused address refuses the destination."""
    for *_, sockaddr in resolved:
        address = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        address_check(address, destination)


def url_check(url: str, *, lookup_seconds: float) -> None:
    """The check of a URL being registered: `Refused` with the finding's rule and message. A name is
    resolved (for at most `lookup_seconds`) and each address checked; a name that does not resolve
    now is admitted, since every delivery resolves and checks it again (and refuses then)."""
    destination = destination_of(url)
    host_check(destination)
    address = literal_address(destination.host)
    if address is not None:
        address_check(address, destination)
        return
    try:
        resolved = resolve(destination, deadline=time.monotonic() + lookup_seconds)
    except (OSError, UnicodeError):
        resolved = []
    if not resolved and destination.scheme == "http":
        raise Refused(
            URL_SCHEME,
            f"url must use https; plain http is admitted only to a loopback address, and "
            f"{destination.host} does not resolve now.",
        )
    resolved_check(destination, resolved)

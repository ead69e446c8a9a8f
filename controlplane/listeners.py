"""serve's two listeners: the addresses `--operator-listen` and `--gateway-listen` take, and which
listener a request came in on (serve records each listener's port in the runtime facts; the ASGI
entry stamps every connection's scope with its listener before Django or Channels sees it)."""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from django.conf import settings
from twisted.internet.endpoints import quoteStringArgument

from controlplane import runtime, tls

OPERATOR = "operator"
GATEWAY = "gateway"
LISTEN_BACKLOG = 1024


def listener_for_scope(scope: dict) -> str:
    server = scope.get("server")
    if server and len(server) >= 2:
        return listener_for_port(server[1])
    return OPERATOR


def listener_for_port(port: int) -> str:
    return runtime.facts.listener_ports.get(port, OPERATOR)


def listener_of(request) -> str:
    """Stamped into the request's environ by the HTTP entry (controlplane/http_threads.py)."""
    return request.META.get("palisade.listener", OPERATOR)


class ListenAddressError(ValueError):
    """A listen or advertise address that cannot be used; the message names the flag and the value."""


_LISTEN = re.compile(r"^(?:\[(?P<ipv6>[^\]]*)\]|(?P<host>[^:\[\]]*)):(?P<port>[0-9]{1,5})$")
_HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")


@dataclass(frozen=True)
class ListenAddress:
    flag: str
    host: str  # as given: "" for all interfaces, a host name, or an IP address
    interface: str  # the IP address to bind
    port: int

    @property
    def is_wildcard(self) -> bool:
        return self.host == ""

    def __str__(self) -> str:
        return f"{bracket(self.interface)}:{self.port}"

    def url(self) -> str:
        host = this_host_name() if self.is_wildcard else bracket(self.host)
        return f"https://{host}:{self.port}/"

    def endpoint(self, cert: tls.CertPaths) -> str:
        parts = [
            "ssl",
            f"port={self.port}",
            # Twisted's 50 overflowed under a burst of connections; the kernel then dropped the SYNs of
            # everyone, and clients waited a second or more for their retry (the kernel caps it at
            # net.core.somaxconn).
            f"backlog={LISTEN_BACKLOG}",
            f"interface={quoteStringArgument(self.interface)}",
            f"privateKey={quoteStringArgument(str(cert.key_path))}",
            f"certKey={quoteStringArgument(str(cert.cert_path))}",
        ]
        if cert.chain_path:
            parts.append(f"extraCertChain={quoteStringArgument(str(cert.chain_path))}")
        return ":".join(parts)


def bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def this_host_name() -> str:
    # getfqdn() gives "localhost" on hosts whose name is an alias of 127.0.0.1; nobody else can use that.
    fqdn = socket.getfqdn()
    return socket.gethostname() if fqdn.startswith("localhost") else fqdn


def _wildcard_interface() -> str:
    """`::` when this kernel does IPv6 with dual-stack sockets (it then accepts IPv4 too), else 0.0.0.0."""
    # Listening on every interface is the documented default for `--listen :PORT` (S104).
    if not socket.has_ipv6:
        return "0.0.0.0"  # noqa: S104
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::", 0))
            v6only = probe.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
    except OSError:
        return "0.0.0.0"  # noqa: S104
    return "0.0.0.0" if v6only else "::"  # noqa: S104


def split_address(flag: str, value: str) -> tuple[str, str | None, int]:
    """`:PORT`, `HOST:PORT` or `[IPV6]:PORT` -> (host as given, its IP address if it is one, port)."""
    match = _LISTEN.match(value.strip())
    if not match or not 0 < int(match["port"]) < 65536:
        raise ListenAddressError(
            f"{flag} {value!r}: expected :PORT, HOST:PORT or [IPV6]:PORT with a port from 1 to 65535"
        )
    port = int(match["port"])
    if match["ipv6"] is not None:
        try:
            address = str(ipaddress.IPv6Address(match["ipv6"]))
        except ValueError:
            raise ListenAddressError(f"{flag} {value!r}: {match['ipv6']!r} is not an IPv6 address") from None
        return address, address, port
    host = match["host"]
    try:
        return host, str(ipaddress.IPv4Address(host)), port
    except ValueError:
        pass
    if host and not _HOST_NAME.match(host):
        raise ListenAddressError(
            f"{flag} {value!r}: {host!r} is not a host name or IPv4 address (write IPv6 as [ADDR])"
        )
    return host, None, port


def parse_listen(flag: str, value: str) -> ListenAddress:
    """`:PORT` (all interfaces), `HOST:PORT` or `[IPV6]:PORT`; a host name is resolved to an address."""
    host, address, port = split_address(flag, value)
    if address is not None:
        return ListenAddress(flag, host, address, port)
    if host == "":
        return ListenAddress(flag, "", _wildcard_interface(), port)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ListenAddressError(f"{flag} {value!r}: cannot resolve {host}: {error.strerror}") from None
    return ListenAddress(flag, host, found[0][4][0], port)


def body_limit(path: str) -> int:
    """The largest body a request to `path` may carry: flow reports, and everything else."""
    from agent.protocol import FLOWS_PATH

    return settings.PALISADE_MAX_FLOW_REPORT_BYTES if path == FLOWS_PATH else settings.PALISADE_MAX_BODY_BYTES

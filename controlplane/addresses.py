"""Which IP addresses name no one host of the network: the unspecified address, loopback (every host
itself), link-local (a link, not a network), multicast and the limited broadcast (many hosts).

Two places refuse them: the addresses an agent says its workload holds (fleet/enrolment.py), since
other workloads' rules admit whatever addresses a workload holds; and the receivers webhooks may
reach (controlplane/webhooks/destinations.py), which adds its own rules on top.
"""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

UNSPECIFIED = "unspecified"
LOOPBACK = "loopback"
LINK_LOCAL = "link-local"
MULTICAST = "multicast"
BROADCAST = "broadcast"

# 0.0.0.0/8 is "this network": as a destination, Linux takes any of it to mean this host.
_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")
_LIMITED_BROADCAST = ipaddress.IPv4Address("255.255.255.255")

WHAT_IT_NAMES = {
    UNSPECIFIED: "no host (as a destination, this host)",
    LOOPBACK: "every host itself",
    LINK_LOCAL: "a host only on one link, not in the network",
    MULTICAST: "a group of hosts",
    BROADCAST: "every host of the local network",
}


def kind_phrase(kind: str) -> str:
    """`an unspecified address`, `a loopback address`, ..."""
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} address"


def plain(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (`::ffff:127.0.0.1`) as the IPv4 address it is: the kernel sends
    to the IPv4 address, and Python's flags (`is_loopback`...) do not look through the mapping."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def special_use(address: IPAddress) -> str | None:
    """UNSPECIFIED, LOOPBACK, LINK_LOCAL, MULTICAST or BROADCAST; None for an address of one host."""
    address = plain(address)
    if isinstance(address, ipaddress.IPv4Address):
        if address in _THIS_NETWORK:
            return UNSPECIFIED
        if address == _LIMITED_BROADCAST:
            return BROADCAST
    elif address.is_unspecified:
        return UNSPECIFIED
    if address.is_loopback:
        return LOOPBACK
    if address.is_link_local:
        return LINK_LOCAL
    if address.is_multicast:
        return MULTICAST
    return None

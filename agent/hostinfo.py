"""What the agent tells the control plane about its host at enrolment: name and addresses."""

from __future__ import annotations

import ipaddress
import json
import shutil
import socket
import subprocess

MAX_ADDRESSES = 64  # the gateway refuses more


def _usable(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if address.is_loopback or address.is_link_local or address.is_multicast or address.is_unspecified:
        return None
    return address


def _from_ip_command() -> list[str] | None:
    ip = shutil.which("ip")
    if ip is None:
        return None
    try:
        done = subprocess.run([ip, "-j", "addr", "show"], capture_output=True, text=True, timeout=10)
        interfaces = json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if not isinstance(interfaces, list):
        return None
    found = []
    for interface in interfaces:
        for info in interface.get("addr_info", []) if isinstance(interface, dict) else []:
            if (
                isinstance(info, dict)
                and info.get("scope") == "global"
                and isinstance(info.get("local"), str)
            ):
                found.append(info["local"])
    return found


def _from_proc_and_resolver() -> list[str]:
    # Without iproute2: IPv6 from the kernel's own list (scope 00 is global), IPv4 from the resolver.
    found = []
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                parts = line.split()
                if len(parts) >= 4 and parts[3] == "00":
                    found.append(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    except OSError:
        pass
    try:
        for *_, sockaddr in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            found.append(sockaddr[0])
    except OSError:
        pass
    return found


def host_addresses() -> list[str]:
    """The host's global-scope addresses (no loopback, no link-local), IPv4 first, at most 64."""
    candidates = _from_ip_command()
    if candidates is None:
        candidates = _from_proc_and_resolver()
    addresses = {a for a in map(_usable, candidates) if a is not None}
    ordered = sorted(addresses, key=lambda a: (a.version, a))
    return [str(a) for a in ordered][:MAX_ADDRESSES]


def host_name() -> str:
    return socket.gethostname()

"""Throwaway network namespaces joined by a bridge, for dataplane tests (root only).

    with Lab.create({"wl": ("10.77.0.10", "fd77::10"), "p1": ("10.77.0.11", None)}) as lab:
        lab.run("wl", ["nft", "list", "ruleset"])
        lab.python("p1", "print(1)")

Every namespace gets one interface ``eth0`` whose other end sits on a bridge in a namespace
of its own, so nothing is created, addressed or filtered in the host's namespace. Names
carry the test process id and a serial number, so labs and parallel runs do not collide;
``close()`` (also on errors) deletes them all, which removes their interfaces, tables and
conntrack entries with them.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.requirements import require

_serial = itertools.count()
REPO = Path(__file__).resolve().parents[2]
TOOLS = ("ip", "nft", "conntrack")


def require_namespace_lab() -> None:
    """Skip (or fail under PALISADE_REQUIRE_ALL=1) unless namespaces and nftables are usable."""
    require(sys.platform == "linux", "network namespaces need Linux")
    require(os.geteuid() == 0, "needs root to create network namespaces and nftables tables")
    for tool in TOOLS:
        require(
            shutil.which(tool) is not None,
            f"needs the '{tool}' command (apt install iproute2 nftables conntrack)",
        )
    try:
        import nftables  # noqa: F401
    except ImportError:
        require(False, "needs the nftables Python module (Debian python3-nftables linked into the venv)")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Lab:
    prefix: str
    hosts: dict[str, tuple[str | None, str | None]]
    created: list[str] = field(default_factory=list)

    @classmethod
    def create(
        cls, hosts: dict[str, tuple[str | None, str | None]], prefix_len: tuple[int, int] = (24, 64)
    ) -> Lab:
        lab = cls(prefix=f"palt{os.getpid()}-{next(_serial)}", hosts=hosts)
        try:
            bridge = lab._add_namespace("br")
            _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", bridge, "link", "set", "br0", "up")
            for index, (name, (v4, v6)) in enumerate(sorted(hosts.items())):
                ns = lab._add_namespace(name)
                port = f"v{index}"
                _ip("-n", bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", bridge, "link", "set", port, "master", "br0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if v4:
                    _ip("-n", ns, "addr", "add", f"{v4}/{prefix_len[0]}", "dev", "eth0")
                if v6:
                    _ip("-n", ns, "addr", "add", f"{v6}/{prefix_len[1]}", "dev", "eth0", "nodad")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _track_connections(ns)
        except BaseException:
            lab.close()
            raise
        return lab

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ns(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def _add_namespace(self, name: str) -> str:
        ns = self.ns(name)
        _ip("netns", "add", ns)
        self.created.append(ns)
        return ns

    def close(self) -> None:
        while self.created:
            ns = self.created.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def run(self, name: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 30)
        return subprocess.run(["ip", "netns", "exec", self.ns(name), *argv], **kwargs)

    def python(
        self, name: str, code: str, *args: str, input: str | None = None
    ) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        return self.run(name, [sys.executable, "-c", code, *args], input=input, env=env)

    def popen_python(self, name: str, code: str, *args: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        return subprocess.Popen(
            ["ip", "netns", "exec", self.ns(name), sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,  # held open: a server can wait on it to learn when to stop
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )


# Runs in the target namespace: one NftablesDataplane call, answered as JSON.
_DATAPLANE_CALL = """
import json, sys
from agent.dataplane import ApplyError, NftablesDataplane
operation = sys.argv[1]
document = sys.stdin.read()
dataplane = NftablesDataplane()
answer = {}
try:
    if operation == "apply":
        dataplane.apply(document)
    elif operation == "dry_run_check":
        answer["result"] = dataplane.dry_run_check(document)
    elif operation == "remove":
        answer["result"] = dataplane.remove()
    elif operation == "table_present":
        answer["result"] = dataplane.table_present()
    answer["error"] = None
except ApplyError as error:
    answer["error"] = error.message
print(json.dumps(answer))
"""


def dataplane_call(lab: Lab, name: str, operation: str, document: str = "") -> dict:
    """Call NftablesDataplane.<operation> inside namespace ``name``; returns {"error", "result"}."""
    done = lab.python(name, _DATAPLANE_CALL, operation, input=document)
    if done.returncode != 0:
        pytest.fail(f"dataplane {operation} in {name} crashed:\n{done.stderr}")
    return json.loads(done.stdout)


# A fresh namespace tracks no connection until something there uses conntrack (the kernel registers
# its hooks on demand), so an agent's stream opened before its first table would be picked up mid-stream
# when that table loads, as a new connection in the direction of its first packet then (a gateway's push:
# an inbound connection from the control plane to an ephemeral port). A host in service tracks its
# connections from boot (any firewall does), and so do the lab's: a table of the lab's own whose one rule
# only counts. docs/flows.md says what a host that tracks nothing before the agent records.
LAB_CONNTRACK_TABLE = (
    "table inet lab_conntrack {\n"
    "\tchain track {\n\t\ttype filter hook prerouting priority 0; policy accept;\n"
    "\t\tct state established counter\n\t}\n}\n"
)


def _track_connections(ns: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "-f", "-"], input=LAB_CONNTRACK_TABLE, text=True, check=True,
        capture_output=True,
    )  # fmt: skip

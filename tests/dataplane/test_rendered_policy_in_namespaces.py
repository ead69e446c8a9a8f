"""Rendered documents applied with NftablesDataplane, judged by real traffic (root only).

One workload namespace runs TCP and UDP echo servers; three peer namespaces connect to it
over a bridge. The policy admits tcp/8080 and udp/5353 from peers labelled role=client.
For each mode the table below says which connections get through and which ct mark the
workload's conntrack entry carries.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest

from policy.grammar import parse_selector
from policy.render_inputs import (
    AddressGroupInput,
    FleetIndex,
    PortEntry,
    RuleInput,
    RulesetInput,
    SourceInput,
    WorkloadInput,
)
from policy.renderer import decode_mark, render
from tests.support.netns import Lab, dataplane_call, require_namespace_lab

pytestmark = pytest.mark.root

HOSTS = {
    "wl": ("10.77.0.10", "fd77::10"),
    "p1": ("10.77.0.11", "fd77::11"),
    "p2": ("10.77.0.12", None),
    "p3": ("10.77.0.13", "fd77::13"),
}
LABELS = {
    "wl": {"role": "server"},
    "p1": {"role": "client"},
    "p2": {"role": "client"},
    "p3": {"role": "other"},
}
TCP_PORTS = (8080, 9090)
UDP_PORTS = (5353, 5354)
ALLOWED_RULE = 41  # rule-clients' lifetime number: the kernel's ct mark carries it


@dataclass(frozen=True)
class Case:
    name: str
    peer: str
    family: int
    protocol: str
    port: int
    admitted_by_rule: bool


# Lifetime rule numbers, as policy.services gives them: one per rule id, never reused.
_RULE_NUMBERS: dict[str, int] = {}


def numbered_rule(id, position, description, sources, entries, number=None) -> RuleInput:
    if number is None:
        number = _RULE_NUMBERS.setdefault(id, len(_RULE_NUMBERS) + 1)
    return RuleInput(id, position, description, sources, entries, number=number)


CASES = (
    Case("client tcp/8080", "p1", 4, "tcp", 8080, True),
    Case("client tcp/8080 over IPv6", "p1", 6, "tcp", 8080, True),
    Case("second client udp/5353", "p2", 4, "udp", 5353, True),
    Case("client tcp/9090 (port not admitted)", "p1", 4, "tcp", 9090, False),
    Case("client udp/5354 (port not admitted)", "p2", 4, "udp", 5354, False),
    Case("other tcp/8080 (peer not role=client)", "p3", 4, "tcp", 8080, False),
    Case("other tcp/8080 over IPv6", "p3", 6, "tcp", 8080, False),
    Case("other udp/5353", "p3", 4, "udp", 5353, False),
)


def expected(mode: str, case: Case) -> tuple[bool, tuple[str, int | None] | None]:
    """(connection gets through, decoded ct mark of its conntrack entry or None for no entry)."""
    if mode == "visibility":
        return True, ("observed", None)
    if case.admitted_by_rule:
        return True, ("allowed", ALLOWED_RULE)
    if mode == "simulation":
        return True, ("would_block", None)
    return False, None  # enforced: dropped before conntrack confirms an entry


def policy() -> tuple[list[RulesetInput], dict[str, AddressGroupInput], FleetIndex]:
    fleet = FleetIndex.build(
        WorkloadInput(name, LABELS[name], tuple(a for a in HOSTS[name] if a), "visibility")
        for name in sorted(HOSTS)
    )
    rulesets = [
        RulesetInput(
            "rs-clients",
            "clients",
            parse_selector("role=server"),
            (
                numbered_rule(
                    "rule-clients",
                    10,
                    "clients reach the app",
                    (SourceInput("selector", parse_selector("role=client")),),
                    (PortEntry("tcp", 8080), PortEntry("udp", 5353)),
                    number=ALLOWED_RULE,
                ),
            ),
        ),
        RulesetInput(
            "rs-admin",
            "a-admin",
            parse_selector("role in (server,db)"),
            (
                numbered_rule(
                    "rule-ssh",
                    1,
                    "ssh from the office",
                    (SourceInput("address_group", address_group_id="g-office"),),
                    (PortEntry("tcp", 22),),
                    number=17,
                ),
            ),
        ),
        RulesetInput(
            "rs-db",
            "db",
            parse_selector("role=db"),
            (numbered_rule("rule-db", 1, "", (SourceInput("any"),), (PortEntry("tcp", 9090),), number=23),),
        ),
    ]
    groups = {"g-office": AddressGroupInput("g-office", "office", ("10.99.0.0/24",))}
    return rulesets, groups, fleet


def document_for(mode: str) -> str:
    rulesets, groups, fleet = policy()
    workload = WorkloadInput("wl", LABELS["wl"], tuple(a for a in HOSTS["wl"] if a), mode)
    return render(workload, rulesets, groups, fleet).document


_SERVERS = """
import socket, sys, threading

def serve_tcp(port):
    server = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    server.bind(("::", port))
    server.listen(64)
    while True:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(2)
            try:
                conn.sendall(conn.recv(64))
            except OSError:
                pass

def serve_udp(port):
    server = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    server.bind(("::", port))
    while True:
        data, peer = server.recvfrom(64)
        server.sendto(data, peer)

for port in TCP_PORTS:
    threading.Thread(target=serve_tcp, args=(port,), daemon=True).start()
for port in UDP_PORTS:
    threading.Thread(target=serve_udp, args=(port,), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()  # the test holds stdin open while it needs the servers
""".replace("TCP_PORTS", repr(TCP_PORTS)).replace("UDP_PORTS", repr(UDP_PORTS))

# Prints {"admitted": bool, "sport": int}; one second is plenty on a bridge, and keeps a
# dropped connection cheap.
_CLIENT = """
import json, socket, sys
protocol, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
family = socket.AF_INET6 if ":" in host else socket.AF_INET
sock = socket.socket(family, socket.SOCK_STREAM if protocol == "tcp" else socket.SOCK_DGRAM)
sock.settimeout(1.0)
sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
sport = sock.getsockname()[1]
try:
    if protocol == "tcp":
        sock.connect((host, port))
        sock.sendall(b"palisade")
        reply = sock.recv(64)
    else:
        sock.sendto(b"palisade", (host, port))
        reply, _ = sock.recvfrom(64)
    admitted = reply == b"palisade"
except OSError:
    admitted = False
finally:
    sock.close()
print(json.dumps({"admitted": admitted, "sport": sport}))
"""


@pytest.fixture(scope="module")
def lab():
    require_namespace_lab()
    with Lab.create(HOSTS) as lab:
        servers = lab.popen_python("wl", _SERVERS)
        try:
            assert servers.stdout.readline().strip() == "ready", servers.stderr.read()
            yield lab
        finally:
            servers.kill()
            servers.wait(timeout=10)


def connect(lab: Lab, case: Case) -> tuple[bool, int]:
    address = HOSTS["wl"][0 if case.family == 4 else 1]
    done = lab.python(case.peer, _CLIENT, case.protocol, address, str(case.port))
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    return answer["admitted"], answer["sport"]


def conntrack_marks(lab: Lab, case: Case, sport: int) -> list[int]:
    source = HOSTS[case.peer][0 if case.family == 4 else 1]
    done = lab.run(
        "wl",
        [
            "conntrack",
            "-L",
            "-f",
            f"ipv{case.family}",
            "-p",
            case.protocol,
            "--orig-src",
            source,
            "--orig-port-src",
            str(sport),
            "--orig-port-dst",
            str(case.port),
        ],
    )
    assert done.returncode == 0, done.stderr
    return [int(m) for m in re.findall(r"\bmark=(\d+)", done.stdout)]


@pytest.mark.parametrize("mode", ["visibility", "simulation", "enforced"])
def test_connections_and_marks_per_mode(lab, mode):
    answer = dataplane_call(lab, "wl", "apply", document_for(mode))
    assert answer["error"] is None
    # Entries from the previous mode would answer for this one; start each mode clean.
    lab.run("wl", ["conntrack", "-F"])

    rows, wrong = [], []
    for case in CASES:
        admitted, sport = connect(lab, case)
        marks = conntrack_marks(lab, case, sport)
        decoded = [decode_mark(m) for m in marks]
        got = (admitted, decoded[0] if len(decoded) == 1 else (None if not decoded else tuple(decoded)))
        want = expected(mode, case)
        rows.append(f"{case.name:42} got {got!s:40} want {want}")
        if got != want:
            wrong.append(case.name)
    assert not wrong, f"mode {mode}:\n" + "\n".join(rows)


def test_table_lists_what_was_rendered(lab):
    dataplane_call(lab, "wl", "apply", document_for("enforced"))
    listed = lab.run("wl", ["nft", "list", "table", "inet", "palisade"]).stdout
    assert "queue-threshold 1 drop" in listed
    assert "10.77.0.11" in listed and "fd77::11" in listed  # role=client peers, both families
    assert "10.77.0.13" not in listed  # role=other is nobody's peer


# A set that holds more than its size: only the kernel notices (while adding elements).
_OVERFLOW = (
    "\tset overflow {\n\t\ttype ipv4_addr\n\t\tsize 2\n\t\telements = { 10.0.0.1, 10.0.0.2, 10.0.0.3 }\n\t}\n"
)
# A jump loop: the kernel refuses it when the batch commits.
_LOOP = "\tchain loop_a {\n\t\tjump loop_b\n\t}\n\tchain loop_b {\n\t\tjump loop_a\n\t}\n"


def _inject(document: str, block: str, hook_jump: bool = False) -> str:
    head, rest = document.split("\n", 1)
    injected = f"{head}\n{block}{rest}"
    if hook_jump:
        injected = injected.replace("policy accept;\n", "policy accept;\n\t\tjump loop_a\n", 1)
    return injected


@pytest.fixture
def solo():
    require_namespace_lab()
    with Lab.create({"solo": (None, None)}) as lab:
        yield lab


def test_refused_documents_leave_the_previous_table(solo):
    good = document_for("enforced")
    assert dataplane_call(solo, "solo", "apply", good)["error"] is None
    before = solo.run("solo", ["nft", "list", "ruleset"]).stdout
    assert "table inet palisade" in before

    refused = {
        "kernel: set overflow": _inject(good, _OVERFLOW),
        "kernel: jump loop": _inject(good, _LOOP, hook_jump=True),
        "parser": good.replace("drop comment", "drp comment"),
        "another table": good + "table ip filter {\n}\n",
        "flush": "flush ruleset\n",
    }
    for what, document in refused.items():
        error = dataplane_call(solo, "solo", "apply", document)["error"]
        assert error, f"{what}: applied"
        assert solo.run("solo", ["nft", "list", "ruleset"]).stdout == before, f"{what}: table changed"

    overflow = dataplane_call(solo, "solo", "apply", refused["kernel: set overflow"])["error"]
    assert "10.0.0.3" in overflow and "document:5:" in overflow  # libnftables' text, document lines
    assert "syntax error" in dataplane_call(solo, "solo", "apply", refused["parser"])["error"]
    assert "jump loop_a" in dataplane_call(solo, "solo", "apply", refused["kernel: jump loop"])["error"]

    assert dataplane_call(solo, "solo", "dry_run_check", good)["result"] is None
    assert (
        "10.0.0.3" in dataplane_call(solo, "solo", "dry_run_check", refused["kernel: set overflow"])["result"]
    )
    assert "syntax error" in dataplane_call(solo, "solo", "dry_run_check", refused["parser"])["result"]
    assert solo.run("solo", ["nft", "list", "ruleset"]).stdout == before


def test_remove_is_the_kill_switch(solo):
    assert dataplane_call(solo, "solo", "table_present")["result"] is False
    assert dataplane_call(solo, "solo", "remove")["result"] is False
    assert dataplane_call(solo, "solo", "apply", document_for("simulation"))["error"] is None
    assert dataplane_call(solo, "solo", "table_present")["result"] is True
    assert dataplane_call(solo, "solo", "remove")["result"] is True
    assert dataplane_call(solo, "solo", "table_present")["result"] is False
    assert "palisade" not in solo.run("solo", ["nft", "list", "ruleset"]).stdout


def rich_policy_documents() -> dict[str, str]:
    """Every construct the renderer emits: groups of both families, any, icmp, port ranges,
    selectors matching nothing or everything, odd names."""
    workloads = [
        WorkloadInput("srv", {"role": "server"}, ("10.1.0.1", "2001:db8::1"), "visibility"),
        *(
            WorkloadInput(
                f"c{i}",
                {"role": "client", "zone": f"z{i % 3}"},
                (f"10.1.1.{i}", f"2001:db8::1:{i:x}"),
                "visibility",
            )
            for i in range(1, 200)
        ),
    ]
    groups = {
        "g1": AddressGroupInput(
            "g1", 'office "east"', ("192.168.0.0/16", "192.168.3.0/24", "2001:db8:ff::/48")
        ),
        "g2": AddressGroupInput("g2", "v6 only", ("2001:db8:aa::5/128",)),
        "g3": AddressGroupInput("g3", "empty", ()),
    }
    entries = (
        PortEntry("tcp", 8000, 8100),
        PortEntry("tcp", 8080),
        PortEntry("udp", 53),
        PortEntry("icmp"),
        PortEntry("icmpv6"),
    )
    rules = (
        numbered_rule(
            "r1",
            1,
            "clients; {braces} and 'quotes' # not a comment",
            (
                SourceInput("selector", parse_selector("role=client,zone!=z1")),
                SourceInput("address_group", address_group_id="g1"),
            ),
            entries,
        ),
        numbered_rule(
            "r2",
            2,
            "",
            (
                SourceInput("selector", parse_selector("role=ghost")),
                SourceInput("address_group", address_group_id="g3"),
            ),
            (PortEntry("tcp", 1),),
        ),
        numbered_rule("r3", 3, "é" * 100, (SourceInput("any"),), entries),
        numbered_rule(
            "r4",
            4,
            "v6 group",
            (
                SourceInput("address_group", address_group_id="g2"),
                SourceInput("selector", parse_selector("")),
            ),
            (PortEntry("udp", 0, 65535),),
        ),
    )
    rulesets = [RulesetInput("rs", "rich $set @x", parse_selector("role=server"), rules)]
    fleet = FleetIndex.build(workloads)
    return {
        mode: render(
            WorkloadInput("srv", {"role": "server"}, ("10.1.0.1",), mode), rulesets, groups, fleet
        ).document
        for mode in ("visibility", "simulation", "enforced")
    }


def test_every_construct_the_renderer_emits_applies(solo):
    for mode, document in rich_policy_documents().items():
        assert dataplane_call(solo, "solo", "dry_run_check", document)["result"] is None, mode
        assert dataplane_call(solo, "solo", "apply", document)["error"] is None, mode
        listed = solo.run("solo", ["nft", "list", "table", "inet", "palisade"])
        assert listed.returncode == 0 and f"mode {mode}" in listed.stdout


def test_apply_replaces_a_table_changed_from_outside(solo):
    assert dataplane_call(solo, "solo", "apply", document_for("enforced"))["error"] is None
    solo.run(
        "solo", ["nft", "add", "rule", "inet", "palisade", "input", "tcp", "dport", "1", "accept"], check=True
    )
    assert dataplane_call(solo, "solo", "apply", document_for("enforced"))["error"] is None
    assert "dport 1 accept" not in solo.run("solo", ["nft", "list", "table", "inet", "palisade"]).stdout

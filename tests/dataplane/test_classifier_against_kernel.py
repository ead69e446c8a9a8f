"""policy.classify against the kernel: the rule it names is the rule the real table marks (root only).

For each seed a random policy (selectors, address groups of hosts and CIDRs, services with
ports and ranges, icmp, icmpv6, ``any``; rulesets that apply and some that do not) is
rendered for the workload namespace and applied with NftablesDataplane; peer namespaces,
each with several IPv4 and IPv6 addresses, make random connections (tcp, udp, icmp and
icmpv6 echo) to a pool of ports; the workload also connects to itself (loopback). Every
connection's conntrack entry is read back and its mark decoded: it must equal the
classifier's (decision, rule) every time. In ``enforced`` a dropped connection has no entry
and must be what the classifier calls ``blocked``; its logged packets (NFLOG, read in the
workload's namespace as the agent reads them) must name the classifier's deny rule, or none.
Some seeds make a share of the rules deny rules, in every ruleset, over every source and
service kind.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from policy.classify import Connection, classify
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
from policy.renderer import MAX_RULES, decode_mark, render
from tests.support.netns import Lab, dataplane_call, require_namespace_lab

pytestmark = pytest.mark.root

WORKLOAD = ("10.78.0.10", "fd78::10")
PEERS = ("p1", "p2", "p3")
PORTS = tuple(range(7001, 7009))
WORKLOAD_LABELS = {"role": "server", "app": "api"}


def peer_addresses(index: int) -> tuple[list[str], list[str]]:
    """Peer p<index>'s addresses: the first of each family is given by Lab.create."""
    return [f"10.78.{index}.{i}" for i in (1, 2, 5, 9)], [f"fd78::{index}:{i}" for i in (1, 2, 7)]


_SERVERS = """
import socket, sys, threading

def serve_tcp(port):
    server = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    server.bind(("::", port))
    server.listen(256)
    while True:
        conn, _ = server.accept()
        conn.close()

def serve_udp(port):
    server = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    server.bind(("::", port))
    while True:
        data, peer = server.recvfrom(64)
        server.sendto(data, peer)

for port in PORTS:
    threading.Thread(target=serve_tcp, args=(port,), daemon=True).start()
    threading.Thread(target=serve_udp, args=(port,), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
""".replace("PORTS", repr(PORTS))

# Reads [[protocol, source, destination, port], ...] on stdin; makes them all at once (a
# dropped one costs its timeout only once) and prints, per connection, the key its conntrack
# entry is found by (source port, or echo id) and whether it was answered.
_CLIENTS = """
import json, socket, struct, sys, threading

def checksum(data):
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF

def one(index, protocol, source, destination, port, answers):
    family = socket.AF_INET6 if ":" in source else socket.AF_INET
    answered, key = False, None
    try:
        if protocol in ("icmp", "icmpv6"):
            ident = (index * 7919 + 17) & 0xFFFF
            if protocol == "icmp":
                sock = socket.socket(family, socket.SOCK_RAW, socket.IPPROTO_ICMP)
                header = struct.pack("!BBHHH", 8, 0, 0, ident, 1) + b"palisade"
                packet = header[:2] + struct.pack("!H", checksum(header)) + header[4:]
            else:
                sock = socket.socket(family, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
                packet = struct.pack("!BBHHH", 128, 0, 0, ident, 1) + b"palisade"  # the kernel sums v6
            sock.settimeout(1.5)
            sock.bind((source, 0))
            sock.sendto(packet, (destination, 0))
            key = ident
            while True:
                data, _ = sock.recvfrom(256)
                reply = data[20:] if protocol == "icmp" else data
                if reply[0] in (0, 129) and struct.unpack("!H", reply[4:6])[0] == ident:
                    answered = True
                    break
        else:
            sock = socket.socket(family, socket.SOCK_STREAM if protocol == "tcp" else socket.SOCK_DGRAM)
            sock.settimeout(1.5)
            sock.bind((source, 0))
            key = sock.getsockname()[1]
            if protocol == "tcp":
                sock.connect((destination, port))
                answered = True
            else:
                sock.sendto(b"palisade", (destination, port))
                answered = sock.recvfrom(64)[0] == b"palisade"
        sock.close()
    except OSError:
        pass
    answers[index] = {"key": key, "answered": answered}

jobs = json.loads(sys.stdin.read())
answers = [None] * len(jobs)
threads = [threading.Thread(target=one, args=(i, *job, answers)) for i, job in enumerate(jobs)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(answers))
"""

SELECTORS = (
    "app=web",
    "app in (web,db)",
    "app!=db",
    "env=prod",
    "env notin (prod)",
    "tier",
    "!tier",
    "app=web,env=prod",
    "",
    "role=server",
    "app=nobody",
)


def random_policy(rng: random.Random, mode: str, deny_share: float = 0.0):
    peers = {name: peer_addresses(i + 1) for i, name in enumerate(PEERS)}
    every_address = [a for four, six in peers.values() for a in four + six]
    workloads = [WorkloadInput("wl", WORKLOAD_LABELS, WORKLOAD, "visibility")]
    # Fleet workloads own some of the peers' addresses; the others are outside the fleet.
    owned = rng.sample(every_address, k=len(every_address) * 2 // 3)
    for i in range(8):
        labels = {"app": rng.choice(("web", "db", "cache"))}
        if rng.random() < 0.6:
            labels["env"] = rng.choice(("prod", "dev"))
        if rng.random() < 0.5:
            labels["tier"] = rng.choice(("1", "2"))
        mine, owned = owned[: rng.randint(1, 3)], owned[3:]
        workloads.append(WorkloadInput(f"w{i}", labels, tuple(mine), "visibility"))

    def group_member() -> str:
        index = rng.randint(1, 3)
        return rng.choice(
            (
                rng.choice(every_address),  # one host
                f"10.78.{index}.0/24",  # a whole peer
                f"10.78.{index}.0/30",  # .1 and .2, not .5 or .9
                f"10.78.{index}.4/30",  # .5 only
                f"fd78::{index}:0/126",  # ::1 and ::2, not ::7
                f"fd78::{index}:0/112",
                "192.0.2.0/24",  # nobody here
                "2001:db8:77::/48",
            )
        )

    groups = {
        f"g{i}": AddressGroupInput(
            f"g{i}", f"group {i}", tuple(group_member() for _ in range(rng.randint(0, 4)))
        )
        for i in range(4)
    }

    def entry() -> PortEntry:
        kind = rng.choice(("tcp", "tcp", "tcp-range", "udp", "udp-range", "icmp", "icmpv6"))
        low = rng.choice(PORTS)
        if kind.endswith("-range"):
            return PortEntry(kind[:3], low, min(low + rng.randint(1, 3), 65535))
        return PortEntry(kind) if kind.startswith("icmp") else PortEntry(kind, low)

    def source() -> SourceInput:
        kind = rng.choice(("selector", "selector", "address_group", "address_group", "any"))
        if kind == "selector":
            return SourceInput("selector", parse_selector(rng.choice(SELECTORS)))
        if kind == "address_group":
            return SourceInput("address_group", address_group_id=rng.choice(sorted(groups)))
        return SourceInput("any")

    numbers = iter(rng.sample(range(1, MAX_RULES + 1), k=40))
    # Their own generator: the seeds without deny rules keep the policies they always had.
    actions = random.Random(rng.random() if deny_share else 0)
    rulesets = []
    for r in range(rng.randint(2, 4)):
        rules = tuple(
            RuleInput(
                f"rs{r}-rule{k}",
                rng.randint(1, 50),
                "",
                tuple(source() for _ in range(rng.randint(1, 2))),
                tuple(entry() for _ in range(rng.randint(1, 3))),
                number=next(numbers),
                action="deny" if actions.random() < deny_share else "allow",
            )
            for k in range(rng.randint(1, 5))
        )
        scope = rng.choice(("role=server", "", "app=api", "app=web", "role"))
        rulesets.append(
            RulesetInput(
                f"rs{r}", rng.choice(("alpha", "beta", "gamma", "delta")), parse_selector(scope), rules
            )
        )
    workload = WorkloadInput("wl", WORKLOAD_LABELS, WORKLOAD, mode)
    return workload, rulesets, groups, FleetIndex.build(workloads)


def random_connections(rng: random.Random, count: int) -> dict[str, list[tuple[str, str, str, int]]]:
    """Per namespace: (protocol, source, destination, port) jobs."""
    jobs: dict[str, list[tuple[str, str, str, int]]] = {}
    for _ in range(count):
        index = rng.randint(1, 3)
        four, six = peer_addresses(index)
        family = rng.choice((4, 6))
        source = rng.choice(four if family == 4 else six)
        protocol = rng.choice(("tcp", "tcp", "udp", "udp", "icmp" if family == 4 else "icmpv6"))
        destination = WORKLOAD[0 if family == 4 else 1]
        jobs.setdefault(PEERS[index - 1], []).append((protocol, source, destination, rng.choice(PORTS)))
    # The workload to itself: loopback, accepted before any rule, never marked.
    for protocol in ("tcp", "udp"):
        jobs.setdefault("wl", []).append((protocol, WORKLOAD[0], WORKLOAD[0], rng.choice(PORTS)))
    return jobs


# In the workload's namespace: binds the blocked NFLOG group as the agent does (agent/nflog.py) and,
# once told to stop on stdin, prints each logged packet's key and the deny rule its prefix names.
_NFLOG_READER = """
import json, select, socket, struct, sys, ipaddress
from agent.nflog import nflog_socket, parse_packets, parse_prefix

def key(payload):
    if payload[0] >> 4 == 4:
        l4, protocol, source = payload[(payload[0] & 15) * 4:], payload[9], ipaddress.IPv4Address(payload[12:16])
    else:
        l4, protocol, source = payload[40:], payload[6], ipaddress.IPv6Address(payload[8:24])
    if protocol in (1, 58):
        return ["icmp" if protocol == 1 else "icmpv6", str(source), struct.unpack("!H", l4[4:6])[0], 0]
    sport, dport = struct.unpack("!HH", l4[:4])
    return ["tcp" if protocol == 6 else "udp", str(source), sport, dport]

sock = nflog_socket(1 << 22)
print("ready", flush=True)
logged, stopping = [], False
while True:
    ready, _, _ = select.select([sock] + ([] if stopping else [sys.stdin]), [], [], 0.3 if stopping else None)
    if not ready:
        break
    if sys.stdin in ready:
        sys.stdin.readline()
        stopping = True
        continue
    for payload, prefix in parse_packets(sock.recv(1 << 20)):
        logged.append([key(payload), *parse_prefix(prefix)])
print(json.dumps(logged), flush=True)
"""


def logged_rules(reader, direction: str = "inbound") -> dict[tuple[str, str, int, int], set[int | None]]:
    """(protocol, source, source port or echo id, destination port or 0) -> deny rules of its drops,
    as their NFLOG prefixes say (agent/nflog.py parse_prefix). A drop whose prefix says the other
    direction is kept under the rule "wrong direction", so that it fails the comparison."""
    out, _ = reader.communicate("stop\n", timeout=30)
    found: dict[tuple[str, str, int, int], set] = {}
    for key, said, rule in json.loads(out.splitlines()[-1]):
        found.setdefault(tuple(key), set()).add(rule if said == direction else f"wrong direction: {said}")
    return found


_ENTRY = re.compile(r"^(?P<proto>tcp|udp|icmp|icmpv6)\s.*?src=(?P<src>\S+) dst=\S+ (?P<rest>.*)$")


def conntrack_marks(lab: Lab) -> dict[tuple[str, str, int, int], list[int]]:
    """(protocol, source, source port or echo id, destination port or 0) -> marks of the entries."""
    found: dict[tuple[str, str, int, int], list[int]] = {}
    for family in ("ipv4", "ipv6"):
        done = lab.run("wl", ["conntrack", "-L", "-f", family])
        assert done.returncode == 0, done.stderr
        for line in done.stdout.splitlines():
            match = _ENTRY.match(line)
            if not match:
                continue
            fields = dict(re.findall(r"(\w+)=(\S+)", match["rest"].split(" src=")[0]))
            mark = int(re.search(r"\bmark=(\d+)", line)[1])
            if match["proto"] in ("icmp", "icmpv6"):
                key = (match["proto"], match["src"], int(fields["id"]), 0)
            else:
                key = (match["proto"], match["src"], int(fields["sport"]), int(fields["dport"]))
            found.setdefault(key, []).append(mark)
    return found


@pytest.fixture(scope="module")
def lab():
    require_namespace_lab()
    hosts = {"wl": WORKLOAD}
    for i, name in enumerate(PEERS, start=1):
        four, six = peer_addresses(i)
        hosts[name] = (four[0], six[0])
    with Lab.create(hosts, prefix_len=(16, 64)) as lab:
        for i, name in enumerate(PEERS, start=1):
            four, six = peer_addresses(i)
            for address in four[1:]:
                lab.run(name, ["ip", "addr", "add", f"{address}/16", "dev", "eth0"], check=True)
            for address in six[1:]:
                lab.run(name, ["ip", "addr", "add", f"{address}/64", "dev", "eth0", "nodad"], check=True)
        servers = lab.popen_python("wl", _SERVERS)
        try:
            assert servers.stdout.readline().strip() == "ready", servers.stderr.read()
            yield lab
        finally:
            servers.kill()
            servers.wait(timeout=10)


@pytest.mark.parametrize(
    ("seed", "mode", "deny_share"),
    [
        (1, "simulation", 0.0),
        (2, "simulation", 0.0),
        (3, "simulation", 0.0),
        (4, "simulation", 0.0),
        (5, "enforced", 0.0),
        (6, "enforced", 0.0),
        # Seeds whose connections meet deny rules (and allows, and no rule).
        (9, "simulation", 0.35),
        (19, "simulation", 0.35),
        (12, "enforced", 0.35),
        (27, "enforced", 0.35),
    ],
)
def test_the_classifier_names_the_rule_the_kernel_marks(lab, seed, mode, deny_share):
    rng = random.Random(seed)
    workload, rulesets, groups, fleet = random_policy(rng, mode, deny_share)
    assert (
        dataplane_call(lab, "wl", "apply", render(workload, rulesets, groups, fleet).document)["error"]
        is None
    )
    lab.run("wl", ["conntrack", "-F"])
    jobs = random_connections(rng, 48)

    reader = lab.popen_python("wl", _NFLOG_READER)
    try:
        assert reader.stdout.readline().strip() == "ready", reader.stderr.read()
        answers = {}
        for name, batch in jobs.items():
            done = lab.python(name, _CLIENTS, input=json.dumps(batch))
            assert done.returncode == 0, done.stderr
            answers[name] = json.loads(done.stdout)
        logged = logged_rules(reader)
    finally:
        reader.kill()
        reader.wait(timeout=10)
    marks = conntrack_marks(lab)

    rows, wrong, decisions, denied = [], 0, set(), 0
    for name, batch in jobs.items():
        for (protocol, source, _, port), answer in zip(batch, answers[name], strict=True):
            outcome = classify(
                workload,
                rulesets,
                groups,
                fleet,
                Connection(
                    source,
                    protocol,
                    8 if protocol == "icmp" else 128 if protocol == "icmpv6" else port,
                    loopback=name == "wl",
                ),
            )
            icmp = protocol in ("icmp", "icmpv6")
            key = (protocol, source, answer["key"], 0 if icmp else port)
            kernel: list = [decode_mark(m) for m in marks.get(key, [])]
            want: list = [(outcome.decision, outcome.rule)]
            if outcome.decision == "blocked":
                # Dropped: no entry; every logged packet of it names the rule that dropped it.
                kernel += [("blocked", rule) for rule in sorted(logged.get(key, ()), key=str)]
            ok = kernel == want and answer["answered"] == outcome.admitted
            wrong += not ok
            decisions.add(outcome.decision)
            denied += outcome.rule is not None and outcome.decision != "allowed"
            rows.append(
                f"{'  ' if ok else '!!'} {name} {protocol:6} {source:>12} -> {port}: kernel {kernel} "
                f"answered={answer['answered']}; classifier {want} admitted={outcome.admitted}"
            )
    assert not wrong, f"seed {seed} ({mode}):\n" + "\n".join(rows)
    # The seed exercised the policy: some connections admitted by a rule, some by none, loopback.
    refused = "blocked" if mode == "enforced" else "would_block"
    assert decisions == {"allowed", refused, None}, "\n".join(rows)
    assert bool(denied) == bool(deny_share), "\n".join(rows)  # deny seeds see deny rules refuse

"""The conntrack flow source against real traffic in network namespaces, counted against ground truth:
L long-lived connections open before the source subscribes, then N admitted and M would-block
connections; every window's counts, decisions and rules exact, bytes with accounting on."""

from __future__ import annotations

import json
import math
import socket
import time

import pytest

from agent import conntrack, netlink
from agent.flowwindow import FlowKey, Windows
from policy.grammar import parse_selector
from policy.render_inputs import FleetIndex, PortEntry, RuleInput, RulesetInput, SourceInput, WorkloadInput
from policy.renderer import render
from tests.support.netns import Lab, dataplane_call, require_namespace_lab
from tests.support.nsthread import NamespaceThread

pytestmark = pytest.mark.root

HOSTS = {"wl": ("10.78.0.10", None), "client": ("10.78.0.11", None)}
ALLOWED_PORT, OTHER_PORT = 8080, 9090
RULE_NUMBER = 4242
LONG_LIVED, ADMITTED, WOULD_BLOCK = 3, 25, 7

_SERVERS = """
import socket, sys, threading
def serve(port):
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(256)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()
def echo(conn):
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)
for port in (PORTS):
    threading.Thread(target=serve, args=(port,), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
""".replace("PORTS", f"{ALLOWED_PORT}, {OTHER_PORT}")

# Opens COUNT connections to PORT, each sending SIZE bytes and reading them back; with HOLD, keeps
# them open until stdin closes. Prints the local ports.
_CLIENT = """
import json, socket, sys
host, port, count, size, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "hold"
socks, ports = [], []
for _ in range(count):
    s = socket.create_connection((host, port), timeout=5)
    s.sendall(b"x" * size)
    got = 0
    while got < size:
        got += len(s.recv(65536))
    ports.append(s.getsockname()[1])
    socks.append(s)
    if not hold:
        s.close()
print(json.dumps(ports), flush=True)
if hold:
    sys.stdin.read()
"""


def _document(mode: str) -> str:
    rule = RuleInput(
        "r-web",
        1,
        "clients reach the app",
        (SourceInput("selector", parse_selector("role=client")),),
        (PortEntry("tcp", ALLOWED_PORT),),
        number=RULE_NUMBER,
    )
    wl = WorkloadInput("wl", {"role": "server"}, (HOSTS["wl"][0],), mode)
    client = WorkloadInput("client", {"role": "client"}, (HOSTS["client"][0],), "visibility")
    rulesets = [RulesetInput("rs", "web", parse_selector("role=server"), (rule,))]
    return render(wl, rulesets, {}, FleetIndex.build([wl, client])).document


@pytest.fixture
def lab():
    require_namespace_lab()
    with Lab.create(HOSTS) as lab:
        lab.run("wl", ["sysctl", "-w", "net.netfilter.nf_conntrack_acct=1"])
        servers = lab.popen_python("wl", _SERVERS)
        try:
            assert servers.stdout.readline().strip() == "ready", servers.stderr.read()
            assert dataplane_call(lab, "wl", "apply", _document("simulation"))["error"] is None
            yield lab
        finally:
            servers.kill()
            servers.wait(timeout=10)


def _drain(sock: socket.socket, counter: conntrack.ConntrackCounter, quiet: float = 1.0) -> None:
    """Read events until none arrives for `quiet` seconds."""
    datagrams = netlink.Datagrams(sock)
    while (entries := conntrack.read_events(datagrams, quiet)) is not None:
        for entry in entries:
            counter.event(entry, time.time())


def test_counts_decisions_rules_and_bytes_equal_ground_truth(lab, monkeypatch):
    read_in_one_unpack = []
    one_unpack = conntrack._ported_tuple
    monkeypatch.setattr(
        conntrack, "_ported_tuple", lambda *at: read_in_one_unpack.append(found := one_unpack(*at)) or found
    )
    wl = NamespaceThread(lab.ns("wl"))
    try:
        held = lab.popen_python(
            "client", _CLIENT, HOSTS["wl"][0], str(ALLOWED_PORT), str(LONG_LIVED), "10", "hold"
        )
        assert len(json.loads(held.stdout.readline())) == LONG_LIVED

        windows = Windows(length=3600, max_keys=1000, accounting=wl.call(conntrack.accounting_enabled))
        counter = conntrack.ConntrackCounter(windows)
        events = wl.call(conntrack.event_socket, 8 << 20)  # join first, then dump
        entries, over = wl.call(conntrack.dump)
        assert over == 0
        counter.subscribed(entries, time.time())

        admitted = lab.python(
            "client", _CLIENT, HOSTS["wl"][0], str(ALLOWED_PORT), str(ADMITTED), "1000", "close"
        )
        blocked = lab.python(
            "client", _CLIENT, HOSTS["wl"][0], str(OTHER_PORT), str(WOULD_BLOCK), "500", "close"
        )
        assert admitted.returncode == 0 and blocked.returncode == 0, admitted.stderr + blocked.stderr
        held.stdin.close()
        held.wait(timeout=10)
        lab.run("wl", ["conntrack", "-D", "-p", "tcp"])  # end every connection now: DESTROY carries the bytes
        _drain(events, counter)
        events.close()
        closed, gaps = windows.close_due(math.inf, "v1")
    finally:
        wl.close()

    assert gaps == []
    totals: dict[FlowKey, list[int]] = {}
    for window in closed:
        for key, counters in window.groups:
            row = totals.setdefault(key, [0, 0, 0])
            row[0] += counters.connection_count
            row[1] += counters.bytes_in
            row[2] += counters.bytes_out
    client = HOSTS["client"][0]
    allowed = FlowKey(client, "tcp", ALLOWED_PORT, "allowed", RULE_NUMBER)
    would_block = FlowKey(client, "tcp", OTHER_PORT, "would_block", None)
    assert set(totals) == {allowed, would_block}, totals
    assert totals[allowed][0] == LONG_LIVED + ADMITTED
    assert totals[would_block][0] == WOULD_BLOCK
    # Every admitted connection sent its payload and got it back: bytes include headers, so at least that.
    assert totals[allowed][1] >= LONG_LIVED * 10 + ADMITTED * 1000
    assert totals[would_block][2] >= WOULD_BLOCK * 500
    # The kernel lays out TCP tuples as the parser's one-unpack path expects (else it walks, slower).
    assert sum(found is not None for found in read_in_one_unpack) >= LONG_LIVED + ADMITTED + WOULD_BLOCK


def test_the_mark_layout_is_the_renderers():
    from policy import renderer

    assert conntrack.DECISION_SHIFT == renderer.DECISION_SHIFT
    assert conntrack.DECISION_NAMES == renderer.DECISION_NAMES
    assert conntrack.decode_mark(renderer.encode_mark(renderer.DECISION_ALLOWED, 77)) == ("allowed", 77)


def test_a_burst_over_a_tiny_buffer_is_a_source_overrun_and_the_redump_recovers_the_counts(lab):
    """ENOBUFS loses events; closed TCP connections linger in the table (TIME_WAIT), so the dump
    that follows the overrun finds every one: the gap says evidence was lost, the counts stay exact."""
    wl = NamespaceThread(lab.ns("wl"))
    try:
        windows = Windows(length=3600, max_keys=1000, accounting=True)
        source = conntrack.ConntrackSource(windows, buffer_bytes=4096, dump_max=100_000)
        wl.call(source.subscribe)
        burst = lab.python("client", _CLIENT, HOSTS["wl"][0], str(ALLOWED_PORT), "300", "10", "close")
        assert burst.returncode == 0, burst.stderr
        quiet = 0
        while quiet < 2:  # read until nothing arrives twice in a row
            quiet = quiet + 1 if wl.call(source.read_once, 0.5) == 0 else 0
        wl.call(source.close)
        closed, _ = windows.close_due(math.inf, "v1")
    finally:
        wl.close()
    assert [(g.kind, g.source) for g in source.gaps] == [("source_overrun", "conntrack")] * len(source.gaps)
    assert source.counter.overruns >= 1 and len(source.gaps) == source.counter.overruns
    allowed = FlowKey(HOSTS["client"][0], "tcp", ALLOWED_PORT, "allowed", RULE_NUMBER)
    assert sum(c.connection_count for w in closed for k, c in w.groups if k == allowed) == 300


def test_more_entries_than_the_dump_bound_is_dump_truncated(lab):
    held = lab.popen_python("client", _CLIENT, HOSTS["wl"][0], str(ALLOWED_PORT), "5", "10", "hold")
    try:
        assert len(json.loads(held.stdout.readline())) == 5
        wl = NamespaceThread(lab.ns("wl"))
        try:
            source = conntrack.ConntrackSource(
                Windows(length=60, max_keys=100, accounting=True), buffer_bytes=1 << 20, dump_max=2
            )
            wl.call(source.subscribe)
            wl.call(source.close)
        finally:
            wl.close()
    finally:
        held.stdin.close()
        held.wait(timeout=10)
    assert [(g.kind, g.source, g.lost) for g in source.gaps] == [
        ("dump_truncated", "conntrack", {"entries": 3})
    ]
    assert len(source.counter.counted) == 2


_BLOCKED_ATTEMPTS = """
import socket, sys, threading
host, tcp_port, udp_port, tcp_attempts, udp_attempts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def attempt():
    s = socket.socket()
    s.settimeout(2.5)  # long enough for the kernel to retransmit the SYN
    try:
        s.connect((host, tcp_port))
    except OSError:
        pass
    s.close()
threads = [threading.Thread(target=attempt) for _ in range(tcp_attempts)]
for t in threads:
    t.start()
for _ in range(udp_attempts):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(3):  # three datagrams, one attempt
        s.sendto(b"x", (host, udp_port))
    s.close()
for t in threads:
    t.join()
"""


def test_blocked_attempts_count_once_each_despite_retransmits(lab):
    from agent import nflog

    assert dataplane_call(lab, "wl", "apply", _document("enforced"))["error"] is None
    wl = NamespaceThread(lab.ns("wl"))
    try:
        windows = Windows(length=3600, max_keys=1000, accounting=True)
        blocked = nflog.NflogSource(windows, buffer_bytes=4 << 20)
        wl.call(blocked.subscribe)
        done = lab.python("client", _BLOCKED_ATTEMPTS, HOSTS["wl"][0], str(OTHER_PORT), "7777", "4", "3")
        assert done.returncode == 0, done.stderr
        packets = 0
        while read := wl.call(blocked.read_once, 1.0):
            packets += read
        wl.call(blocked.close)
        closed, _ = windows.close_due(math.inf, "v1")
    finally:
        wl.close()
    counts = {key: c.connection_count for w in closed for key, c in w.groups}
    client = HOSTS["client"][0]
    assert counts == {
        FlowKey(client, "tcp", OTHER_PORT, "blocked", None): 4,
        FlowKey(client, "udp", 7777, "blocked", None): 3,
    }
    assert packets >= 4 * 2 + 3 * 3  # retransmits and repeats were there, and counted once
    assert blocked.gaps == []


def test_the_nflog_group_is_the_renderers():
    from agent import nflog
    from policy import renderer

    assert nflog.NFLOG_GROUP_BLOCKED == renderer.NFLOG_GROUP_BLOCKED


def test_dropped_packets_over_a_tiny_nflog_buffer_are_a_source_overrun_covering_the_loss(lab):
    """Nothing reads while 500 blocked datagrams arrive on a 4 KiB buffer: ENOBUFS, and the gap runs
    from the last packet read before it to the moment the queue was read empty (until then the kernel
    drops silently), so every attempt not counted lies inside it."""
    from agent import nflog

    assert dataplane_call(lab, "wl", "apply", _document("enforced"))["error"] is None
    wl = NamespaceThread(lab.ns("wl"))
    try:
        windows = Windows(length=3600, max_keys=100_000, accounting=True)
        blocked = nflog.NflogSource(windows, buffer_bytes=4096)
        wl.call(blocked.subscribe)
        sent_at = time.time()
        done = lab.python("client", _UDP_ATTEMPTS, HOSTS["wl"][0], "500")
        assert done.returncode == 0, done.stderr
        burst_done_at = time.time()
        quiet = 0
        while quiet < 2:  # read until nothing arrives twice in a row
            quiet = quiet + 1 if wl.call(blocked.read_once, 0.5) == 0 else 0
        drained_at = time.time()
        wl.call(blocked.close)
        closed, _ = windows.close_due(math.inf, "v1")
    finally:
        wl.close()
    counted = sum(c.connection_count for w in closed for _, c in w.groups)
    assert [(g.kind, g.source) for g in blocked.gaps] == [("source_overrun", "nflog")] * len(blocked.gaps)
    assert blocked.gaps and counted < 500  # evidence was lost, and said so
    first = blocked.gaps[0]
    # Nothing was read before the failure: the loss may lie anywhere since the subscription.
    assert first.start <= sent_at and burst_done_at <= first.end <= drained_at, (sent_at, first, drained_at)


# One datagram from each of COUNT source ports to port 7777: COUNT blocked attempts.
_UDP_ATTEMPTS = """
import socket, sys
host, count = sys.argv[1], int(sys.argv[2])
for source_port in range(30000, 30000 + count):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", source_port))
    s.sendto(b"x", (host, 7777))
    s.close()
"""


def test_accounting_switched_on_while_the_source_runs_counts_bytes_in_windows_opened_after(lab):
    """nf_conntrack_acct switched on while the agent runs: the source reads it (once a second), windows
    opened afterwards count the bytes of connections opened afterwards, and the windows before say
    "not counted" rather than show zero bytes as if counted."""
    lab.run("wl", ["sysctl", "-w", "net.netfilter.nf_conntrack_acct=0"])
    wl = NamespaceThread(lab.ns("wl"))

    def read_for(seconds: float) -> None:
        until = time.time() + seconds
        while time.time() < until:
            wl.call(source.read_once, 0.2)

    try:
        windows = Windows(length=2, max_keys=1000, accounting=False)  # as the agent started: off
        source = conntrack.ConntrackSource(windows, buffer_bytes=8 << 20, dump_max=100_000)
        wl.call(source.subscribe)
        before = lab.python("client", _CLIENT, HOSTS["wl"][0], str(ALLOWED_PORT), "2", "1000", "close")
        lab.run("wl", ["conntrack", "-D", "-p", "tcp"])  # their ends, without counters
        read_for(1.0)
        lab.run("wl", ["sysctl", "-w", "net.netfilter.nf_conntrack_acct=1"])
        read_for(2.5)  # the setting read again, and a window boundary passed
        after = lab.python("client", _CLIENT, HOSTS["wl"][0], str(ALLOWED_PORT), "3", "1000", "close")
        lab.run("wl", ["conntrack", "-D", "-p", "tcp"])  # their ends, with their bytes
        read_for(1.5)
        wl.call(source.close)
        closed, _ = windows.close_due(math.inf, "v1")
    finally:
        wl.close()
    assert before.returncode == 0 and after.returncode == 0, before.stderr + after.stderr
    assert sum(c.connection_count for w in closed for _, c in w.groups) == 5
    assert closed[0].accounting is False and closed[-1].accounting is True, [w.accounting for w in closed]
    assert all(c.bytes_in == c.bytes_out == 0 for w in closed if not w.accounting for _, c in w.groups)
    counted = [c for w in closed if w.accounting for _, c in w.groups]
    assert sum(c.connection_count for c in counted) == 3
    assert sum(c.bytes_in for c in counted) >= 3 * 1000 and sum(c.bytes_out for c in counted) >= 3 * 1000

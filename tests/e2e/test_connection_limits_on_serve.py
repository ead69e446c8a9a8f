"""The real serve, with 1,024 descriptors (`prlimit --nofile=1024`), against 1,100 connections that never
finish their TLS handshake: from one address (127.0.0.2, which also holds unfinished heads, websockets
that never authenticate and slow bodies), then from 1,100 addresses (127.0.3.1 on). Meanwhile
`GET /me`, an enrolment and a flow report from 127.0.0.1 answer promptly, and serve never holds more
descriptors than its limit allows. Before the limits (controlplane/connection_limits.py) the first
thousand such connections took every descriptor: the listeners refused everyone.

With a short head deadline and room for 300: websockets that never authenticate and slow bodies from
400 addresses silence nobody either; a head sent a byte at a time is cut, and an agent's stream
outlives the deadline.
"""

from __future__ import annotations

import itertools
import os
import resource
import shutil
import socket
import ssl
import time
from contextlib import contextmanager

import pytest

from agent.enrol import enrol
from agent.flowreport import report_body
from agent.protocol import STREAM_PATH
from agent.state import StateDir
from tests.support.flow_reports import post_flow_report
from tests.support.requirements import require
from tests.support.scripted_agent import ScriptedStreams
from tests.support.serve_process import Site

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

DESCRIPTORS = 1024
ATTACKERS = 1100
SHORT_CAP = 300
PROMPTLY = 5.0  # seconds: generous; an answer takes milliseconds, a silenced listener never answers


def _partial_client_hello() -> bytes:
    """The first bytes of a real TLS ClientHello: the server waits for the rest, which never comes."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    outgoing = ssl.MemoryBIO()
    tls = context.wrap_bio(ssl.MemoryBIO(), outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()[:20]


@contextmanager
def _slow_connections(targets: list[tuple[str, int]], sources: list[str]):
    """One connection from each source address in turn to each target in turn, all held open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    require(
        hard == resource.RLIM_INFINITY or hard >= ATTACKERS + 200,
        f"this test needs {ATTACKERS + 200} descriptors; the hard limit is {hard}",
    )
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    hello = _partial_client_hello()
    sockets = []
    try:
        for index in range(ATTACKERS):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setblocking(False)
            sock.bind((sources[index % len(sources)], 0))
            sock.connect_ex(targets[index % len(targets)])
        deadline = time.monotonic() + 10
        pending = list(sockets)
        while pending and time.monotonic() < deadline:
            still = []
            for sock in pending:
                try:
                    sock.send(hello)
                except (BlockingIOError, InterruptedError):
                    still.append(sock)  # not connected yet
                except OSError:
                    pass  # refused by serve: closed as soon as it was accepted
            pending = still
            time.sleep(0.05)
        # Held means accepted: until serve has taken them all, a newcomer's connection waits in the
        # kernel's queue behind them, and what is measured is the queue, not serve. The queue gets a
        # deadline of its own: on a busy machine the sends can take most of theirs (seen once beside
        # another test: 199 held where 412 are needed).
        deadline = time.monotonic() + 30
        while _accept_queue([port for _, port in targets]) and time.monotonic() < deadline:
            time.sleep(0.05)
        yield sockets
    finally:
        for sock in sockets:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextmanager
def _started_requests(serve, sources: list[str], count: int, kinds: slice = slice(None), token: str = ""):
    """TLS connections from each source in turn that each start something and never finish it: a
    request head on the operator listener, a websocket upgrade that never authenticates, and a body at
    ten bytes in all: a write with the operator's token (its body admitted: a body without a credential
    is refused before it is read, controlplane/body_gate.py)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    starts = [
        ("operator", b"GET /api/v1/me HTTP/1.1\r\nHost: palisade\r\nUser-Agent: slo"),
        ("gateway", b"GET " + STREAM_PATH.encode() + b" HTTP/1.1\r\nHost: palisade\r\nUpgrade: websocket\r\n"
         b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"),
        ("operator", b"POST /api/v1/services HTTP/1.1\r\nHost: palisade\r\nAuthorization: Bearer " + token.encode()
         + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n0123456789"),
    ][kinds]  # fmt: skip
    held = []
    try:
        for index in range(count):
            listener, data = starts[index % len(starts)]
            raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            raw.settimeout(5)
            raw.bind((sources[index % len(sources)], 0))
            try:
                raw.connect(serve.address(listener))
                tls = context.wrap_socket(raw)
                tls.sendall(data)
            except OSError:  # over a cap, or closed for room by the next one
                raw.close()
                continue
            held.append(tls)
        yield held
    finally:
        for sock in held:
            sock.close()


def _accept_queue(ports: list[int]) -> int:
    """Connections the kernel has completed for these listening ports that serve has not accepted yet
    (the receive queue of a listening socket, in /proc/net/tcp)."""
    waiting = 0
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            port = int(fields[1].rsplit(":", 1)[1], 16)
            if fields[3] == "0A" and port in ports:  # LISTEN
                waiting += int(fields[4].split(":")[1], 16)
    return waiting


def _open_descriptors(serve) -> int:
    return len(os.listdir(f"/proc/{serve.process.pid}/fd"))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    require(shutil.which("prlimit") is not None, "prlimit (util-linux) is not installed")
    root = tmp_path_factory.mktemp("limits")
    with Site.fresh(root / "data", migrated=True) as site:
        yield site, root


@pytest.fixture(scope="module")
def limited(site):
    """serve with 1,024 descriptors, an operator token, a provisioning bundle and an enrolled agent."""
    site, root = site
    serve = site.serve(command_prefix=("prlimit", f"--nofile={DESCRIPTORS}"))
    token = serve.mint_operator_token()
    with serve.client("operator", headers={"Authorization": f"Bearer {token}"}) as operator:
        bundle = operator.post(
            "/api/v1/provisioning-tokens", json={"description": "limits", "max_uses": 5}
        ).json()
    enrol(bundle["bundle"], str(root / "reporter"), hostname="reporter", addresses=["10.60.0.1"])
    reporter = StateDir(root / "reporter").load_enrolment()
    yield serve, token, bundle["bundle"], reporter, root
    assert serve.stop() == 0
    assert "Traceback" not in serve.stderr_text()


_check_addresses = itertools.count(1)


def _others_are_answered(serve, token: str, bundle: str, reporter, root, name: str) -> None:
    started = time.monotonic()
    with serve.client("operator", headers={"Authorization": f"Bearer {token}"}) as op:
        assert op.get("/api/v1/me", timeout=PROMPTLY * 2).status_code == 200
    me = time.monotonic() - started

    started = time.monotonic()
    # An address belongs to one enrolled workload: each check enrols a host of its own.
    address = f"10.60.1.{next(_check_addresses)}"
    enrol(bundle, str(root / name), hostname=name, addresses=[address], timeout=PROMPTLY * 2)
    enrolment = time.monotonic() - started

    started = time.monotonic()
    body = report_body([], [], now=time.time(), process_start_id="p1", uptime_seconds=60.0, window_seconds=60)
    assert post_flow_report(serve, reporter, body).status_code == 200
    report = time.monotonic() - started

    assert max(me, enrolment, report) < PROMPTLY, (me, enrolment, report)


def test_one_address_with_1100_slow_connections_silences_nobody(limited):
    serve, token, bundle, reporter, root = limited
    targets = [serve.address("operator"), serve.address("gateway")]
    with _started_requests(serve, ["127.0.0.2"], 120, token=token), _slow_connections(targets, ["127.0.0.2"]):
        held = _open_descriptors(serve)
        _others_are_answered(serve, token, bundle, reporter, root, "during-one")
    serve.wait_for_stderr(r"connections refused or closed: .*over the per-address cap of 256")
    assert held < 256 + 100, held  # its cap, and serve's own descriptors


def test_1100_addresses_with_a_slow_connection_each_silence_nobody(limited):
    serve, token, bundle, reporter, root = limited
    targets = [serve.address("operator"), serve.address("gateway")]
    sources = [f"127.0.{3 + i // 250}.{1 + i % 250}" for i in range(ATTACKERS)]
    with _slow_connections(targets, sources):
        held = _open_descriptors(serve)
        _others_are_answered(serve, token, bundle, reporter, root, "during-many")
    found = serve.wait_for_stderr(r"connections: at most (\d+) .* (\d+) handshakes per listener")
    cap, handshakes = int(found[1]), int(found[2])
    # Every connection up to the cap, or up to each listener's bound on unfinished handshakes (each
    # of them a ClientHello begun and not finished: stalled), then the longest waiting or the oldest
    # stalled made room for each newcomer; descriptors stayed free for the database and serve's
    # files. Connections cut for room close on the reactor's next turn, so a busy machine sees up to a
    # couple of hundred still open beside the cap.
    assert min(cap, 2 * handshakes) - 100 < held < DESCRIPTORS - 32, (held, cap)
    # Logged with everything else refused or closed, one line every 10 s at most.
    serve.wait_for_stderr(
        r"closed to admit a new one \(a stalled unfinished handshake of its listener\)", timeout=25
    )


@pytest.fixture(scope="module")
def short(site):
    """serve with a 2 s head deadline and room for 300 connections, an operator token and a bundle."""
    site, root = site
    serve = site.serve(["--request-head-timeout", "2", "--max-connections", str(SHORT_CAP)])
    token = serve.mint_operator_token("short")
    with serve.client("operator", headers={"Authorization": f"Bearer {token}"}) as operator:
        bundle = operator.post("/api/v1/provisioning-tokens", json={"description": "short", "max_uses": 5})
    yield serve, token, bundle.json()["bundle"], root
    assert serve.stop() == 0
    assert "Traceback" not in serve.stderr_text()


def test_addresses_with_an_unauthenticated_websocket_or_a_slow_body_each_silence_nobody(short, limited):
    serve, token, bundle, root = short
    reporter = limited[3]  # enrolled on this site; both serves present the same gateway certificate
    sources = [f"127.0.{3 + i // 250}.{1 + i % 250}" for i in range(SHORT_CAP + 100)]
    with _started_requests(serve, sources, len(sources), kinds=slice(1, 3), token=token):
        _others_are_answered(serve, token, bundle, reporter, root, "during-streams")
    # At the cap, with no connection waiting for a head, the youngest streams and slowest bodies made
    # room: for the rest of the attackers, and for the three above (logged once every 10 s at most).
    serve.wait_for_stderr(
        r"closed to admit a new one \(a websocket too young to have authenticated\)", timeout=15
    )


def test_a_dribbled_head_is_cut_at_the_deadline_and_a_stream_outlives_it(short):
    serve, token, bundle, root = short
    enrol(bundle, str(root / "streamer"), hostname="streamer", addresses=["10.60.0.2"])
    streams = ScriptedStreams()
    try:
        streams.hold(StateDir(root / "streamer").load_enrolment(), role="synced")

        host, port = serve.address("operator")
        der = serve.served_certificate("operator")
        context = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(der))
        context.check_hostname = False
        with socket.create_connection((host, port), timeout=10) as raw:
            with context.wrap_socket(raw) as tls:
                started, cut_after = time.monotonic(), None
                try:
                    for byte in b"GET /api/v1/me HTTP/1.1\r\nHost: palisade\r\n":
                        tls.sendall(bytes([byte]))
                        time.sleep(0.25)  # Twisted's own idle timer is reset by every byte
                    if tls.recv(1) == b"":  # not cut while sending: 10 s of it, then a read
                        cut_after = time.monotonic() - started
                except (ConnectionError, ssl.SSLError):  # reset, or EOF mid-record; not a timeout
                    cut_after = time.monotonic() - started
        assert cut_after is not None and cut_after < 6, cut_after  # 2 s, and the once-a-second sweep
        time.sleep(3)
        assert not streams.errors and not any(task.done() for task in streams.tasks)
    finally:
        streams.close()

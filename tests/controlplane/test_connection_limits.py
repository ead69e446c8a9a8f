"""serve's connection limits (controlplane/connection_limits.py) on Twisted's own HTTP/1.1 channel
(controlplane/http_limits.py), driven by a clock the test moves: a head dribbled one byte at a time, a
slow body, idle keep-alive, a websocket upgrade, the caps. The real serve, under a descriptor limit and
over TLS, is in tests/e2e/test_connection_limits_on_serve.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web import http

from controlplane.connection_limits import (
    CLIENT_TURN_SECONDS,
    HELLO_SECONDS,
    ConnectionLimiter,
    LimitingFactory,
    Limits,
    LimitsError,
    Phase,
    address_key,
    limits_from_options,
)
from controlplane.http_limits import SPOOL_BYTES, BodyFile, LimitedHTTPChannel

HEAD_TIMEOUT = 15.0
HEAD = b"GET /api/v1/me HTTP/1.1\r\nHost: palisade\r\nUser-Agent: slow\r\n\r\n"


class Answering(http.Request):
    """Answers at once, like a quick view."""

    def process(self):
        self.setResponseCode(200)
        self.write(b"ok")
        self.finish()


@pytest.fixture(autouse=True)
def fresh_body_budgets(monkeypatch):
    """Each test's bodies against budgets of its own: StringTransport's loseConnection never reports the
    connection lost, so the bodies of a test's cut connections would hold budget into the next test.
    And no credential check before a body (the operator listener's, tests/e2e/test_gateway_bodies.py):
    these tests are of the connection's phases, which a check on a thread would hold still."""
    from controlplane import body_gate

    monkeypatch.setattr(body_gate, "_budgets", {})
    monkeypatch.setattr(body_gate, "operator_credential_check", None)


class Pending(http.Request):
    """Never answers: a request being worked on, or a websocket daphne took over."""

    def process(self):
        pass


def _site(request_class=Answering, **limits) -> tuple[Clock, ConnectionLimiter, LimitingFactory]:
    clock = Clock()
    settings = {
        "max_connections": 100,
        "max_per_address": 10,
        "max_handshakes": 0,
        "head_timeout": HEAD_TIMEOUT,
        "body_min_rate": 1000,
    }
    limiter = ConnectionLimiter(Limits(**(settings | limits)), clock=clock)
    limiter.start()
    inner = http.HTTPFactory(reactor=clock)
    inner.protocol = lambda: _channel(request_class)
    return clock, limiter, LimitingFactory(inner, limiter)


def _channel(request_class):
    channel = LimitedHTTPChannel()
    channel.requestFactory = request_class
    return channel


def _connect(factory: LimitingFactory, host: str = "192.0.2.7", port: int = 40000):
    addr = IPv6Address("TCP", host, port) if ":" in host else IPv4Address("TCP", host, port)
    connection = factory.buildProtocol(addr)
    if connection is None:
        return None, None
    transport = StringTransport(peerAddress=addr)
    connection.makeConnection(transport)
    return connection, transport


def test_a_head_dribbled_one_byte_at_a_time_is_cut_at_the_deadline():
    clock, limiter, factory = _site()
    connection, transport = _connect(factory)
    # One byte a second resets Twisted's own idle timer every time; the deadline does not move.
    for byte in HEAD[:-1]:
        connection.dataReceived(bytes([byte]))
        clock.advance(0.25)
    assert not transport.disconnected  # 15 s of dribbling, still inside the deadline
    clock.advance(HEAD_TIMEOUT - 0.25 * (len(HEAD) - 1) + 1)
    assert transport.disconnected
    assert limiter.total == 0 and not limiter.by_address


def test_a_head_never_started_is_cut_too():
    # What a TLS handshake that never finishes looks like from here: no bytes the channel can parse.
    clock, limiter, factory = _site()
    _, transport = _connect(factory)
    clock.advance(HEAD_TIMEOUT - 1)
    assert not transport.disconnected
    clock.advance(2)
    assert transport.disconnected


def test_a_complete_head_is_answered_and_an_idle_keep_alive_connection_is_closed_later():
    clock, limiter, factory = _site()
    connection, transport = _connect(factory)
    clock.advance(HEAD_TIMEOUT - 1)
    connection.dataReceived(HEAD)
    assert transport.value().startswith(b"HTTP/1.1 200")
    assert connection.phase is Phase.HEAD  # ready for the next request, with a fresh deadline
    clock.advance(HEAD_TIMEOUT - 1)
    assert not transport.disconnected
    clock.advance(2)
    assert transport.disconnected


class Sending(StringTransport):
    """What twisted's TCP transport shows of the bytes the kernel has not taken yet."""

    dataBuffer = b""
    offset = 0
    _tempDataLen = 0


def test_a_client_reading_a_large_answer_keeps_its_connection_while_it_reads():
    clock, limiter, factory = _site()
    addr = IPv4Address("TCP", "192.0.2.7", 1)
    connection = factory.buildProtocol(addr)
    transport = Sending(peerAddress=addr)
    connection.makeConnection(transport)
    transport.dataBuffer = b"x" * 100_000  # the answer, not yet sent when the request is done
    connection.dataReceived(HEAD)
    assert connection.phase is Phase.HEAD
    clock.advance(10)
    transport.offset = 90_000  # read at 9,000 bytes/s
    clock.advance(HEAD_TIMEOUT - 10 + 1)
    assert not transport.disconnected
    clock.advance(3)  # and then it stops reading
    assert transport.disconnected


def test_a_client_that_never_reads_its_answer_is_cut_at_the_deadline():
    clock, limiter, factory = _site()
    addr = IPv4Address("TCP", "192.0.2.7", 1)
    connection = factory.buildProtocol(addr)
    transport = Sending(peerAddress=addr)
    connection.makeConnection(transport)
    transport.dataBuffer = b"x" * 100_000
    connection.dataReceived(HEAD.replace(b"HTTP/1.1", b"HTTP/1.0"))  # not persistent: Twisted waits to close
    clock.advance(HEAD_TIMEOUT + 1)
    assert transport.disconnected


def test_a_body_slower_than_the_minimum_rate_is_cut_and_a_steady_one_is_not():
    clock, limiter, factory = _site()
    head = b"POST /agent/v1/flows HTTP/1.1\r\nHost: palisade\r\nContent-Length: 100000\r\n\r\n"
    slow, slow_transport = _connect(factory, port=1)
    steady, steady_transport = _connect(factory, port=2)
    slow.dataReceived(head)
    steady.dataReceived(head)
    assert slow.phase is Phase.BODY
    for _ in range(40):  # 40 s: the grace (10 s) and then 1,000 bytes a second
        slow.dataReceived(b"x" * 10)
        steady.dataReceived(b"x" * 1500)
        clock.advance(1)
    assert slow_transport.disconnected
    assert not steady_transport.disconnected and steady.phase is Phase.BODY
    steady.dataReceived(b"x" * (100000 - 40 * 1500))
    assert steady.phase is Phase.HEAD and steady_transport.value().startswith(b"HTTP/1.1 200")


def test_a_gateway_body_keeps_the_gateways_pace_after_its_grace_declared_or_chunked(caplog):
    """1.6 KB/s is above the general minimum (1,000 bytes/s here) and below the gateway's 16 KiB/s: such a
    body is closed once it falls behind 16 KiB/s after its 10 s grace, whether its length is declared
    or not; one sent at the pace is received."""
    from controlplane import runtime

    runtime.facts.listener_ports[12345] = "gateway"  # the port StringTransport says it was accepted on
    clock, limiter, factory = _site(request_class=Pending)
    declared = b"POST /agent/v1/enrol HTTP/1.1\r\nHost: palisade\r\nContent-Length: 60000\r\n\r\n"
    chunked = b"POST /agent/v1/enrol HTTP/1.1\r\nHost: palisade\r\nTransfer-Encoding: chunked\r\n\r\n"
    (slow, slow_transport), (chunky, chunky_transport), (steady, steady_transport) = (
        _connect(factory, port=port) for port in (1, 2, 3)
    )
    for connection, head in ((slow, declared), (chunky, chunked), (steady, declared)):
        connection.dataReceived(head)
    assert slow.body_rate == 16 * 1024 and slow.phase is Phase.BODY
    for second in range(13):
        slow.dataReceived(b"x" * 1600)
        chunky.dataReceived(b"640\r\n" + b"x" * 1600 + b"\r\n")
        if second < 3:
            steady.dataReceived(b"x" * 20_000)
        clock.advance(1)
        if second < 10:  # within the grace: 10 s + what has arrived at 16 KiB/s
            assert not slow_transport.disconnected and not chunky_transport.disconnected
    assert slow_transport.disconnected and chunky_transport.disconnected
    assert not steady_transport.disconnected and steady.phase is Phase.BUSY
    assert "2 a request body slower than 16384 bytes/s" in caplog.text


def test_a_request_being_answered_and_a_websocket_have_no_deadline():
    clock, limiter, factory = _site(request_class=Pending)
    busy, busy_transport = _connect(factory, port=1)
    stream, stream_transport = _connect(factory, port=2)
    busy.dataReceived(HEAD)
    stream.dataReceived(
        b"GET /agent/v1/stream HTTP/1.1\r\nHost: palisade\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    assert (busy.phase, stream.phase) == (Phase.BUSY, Phase.STREAM)
    clock.advance(3600)
    assert not busy_transport.disconnected and not stream_transport.disconnected
    assert limiter.total == 2


def test_one_address_gets_its_cap_and_everyone_else_still_gets_in():
    clock, limiter, factory = _site(max_per_address=3)
    held = [_connect(factory, "192.0.2.7", port)[0] for port in range(5)]
    assert [c is not None for c in held] == [True, True, True, False, False]
    # The same IPv4 address through a dual-stack listener counts against the same cap.
    assert _connect(factory, "::ffff:192.0.2.7")[0] is None
    assert _connect(factory, "192.0.2.8")[0] is not None
    assert limiter.by_address == {"192.0.2.7": 3, "192.0.2.8": 1}
    held[0].connectionLost(Failure(ConnectionDone()))
    assert _connect(factory, "192.0.2.7")[0] is not None


def test_agents_streams_past_their_handshake_leave_their_address_cap_to_the_rest():
    """A fleet behind one NAT address or a TCP load balancer: its settled streams are not held to the
    cap of one address, which is for connections that have not shown what they are."""
    clock, limiter, factory = _site(request_class=Pending, max_per_address=3)
    upgrade = b"GET /agent/v1/stream HTTP/1.1\r\nHost: palisade\r\nUpgrade: websocket\r\n\r\n"
    streams = [_connect(factory, port=port)[0] for port in range(3)]
    for stream in streams:
        stream.dataReceived(upgrade)
    assert _connect(factory, port=3)[0] is None  # young streams still count: they may not authenticate
    clock.advance(20)
    more = [_connect(factory, port=port)[0] for port in range(4, 10)]
    assert [c is not None for c in more] == [True, True, True, False, False, False]
    assert limiter.total == 6 and limiter.by_address == {"192.0.2.7": 3}
    streams[0].connectionLost(Failure(ConnectionDone()))  # a settled stream's end frees no address slot
    assert limiter.total == 5 and limiter.by_address == {"192.0.2.7": 3}


def test_an_ipv6_client_is_counted_by_its_64():
    assert address_key("2001:db8:1:2::5") == address_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::5") != address_key("2001:db8:1:2::5")
    assert address_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert address_key("fe80::1%eth0") == "fe80::/64"


HELLO_PART = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"  # a ClientHello's first bytes, no more


def test_a_listener_bounds_its_unfinished_handshakes_and_refuses_the_new_one_while_they_progress():
    """Thousands of agents at one gateway at once (a failover): past the bound the new connection is
    refused as it is accepted, and the handshakes admitted finish; closing the oldest for each newcomer
    cut every handshake just before it finished. A connection that sent its head no longer counts, and
    each listener has its own bound."""
    clock, limiter, factory = _site(request_class=Pending, max_handshakes=3, max_per_address=0)
    other = LimitingFactory(factory.wrappedFactory, limiter, "operator")
    first, first_transport = _connect(factory, port=1)
    second, second_transport = _connect(factory, port=2)
    done, done_transport = _connect(factory, port=3)
    done.dataReceived(HEAD)  # its head came: its handshake is over
    third, third_transport = _connect(factory, port=4)
    for connection in (first, second, third):
        connection.write(b"server hello")  # what TLS answers to a whole ClientHello: the client's turn
    assert len(factory.unfinished) == 3
    assert _connect(other, port=5)[0] is not None  # the other listener is not held to this one's bound
    clock.advance(CLIENT_TURN_SECONDS - 1)

    assert _connect(factory, port=6)[0] is None  # refused: every unfinished one is progressing
    assert not any(t.disconnected for t in (first_transport, second_transport, third_transport))
    assert limiter.total == 5 and len(factory.unfinished) == 3
    assert limiter.events["refused at accept (its listener's unfinished handshakes all progressing)"] == 1
    second.connectionLost(Failure(ConnectionDone()))  # a handshake that failed frees its place
    assert _connect(factory, port=7)[0] is not None
    assert not third_transport.disconnected and len(factory.unfinished) == 3


def test_at_the_bound_a_stalled_handshake_makes_room_so_nobody_holding_them_shuts_others_out():
    """Part of a ClientHello and then nothing (serve has nothing to answer) is stalled at once; a
    connection that sent nothing, once HELLO_SECONDS have passed; one that serve answered, once the
    client has taken CLIENT_TURN_SECONDS since. The oldest stalled one is closed for the newcomer."""
    clock, limiter, factory = _site(request_class=Pending, max_handshakes=3, max_per_address=0)
    silent, silent_transport = _connect(factory, port=1)
    answered, answered_transport = _connect(factory, port=2)
    answered.write(b"server hello")
    partial, partial_transport = _connect(factory, port=3)
    partial.dataReceived(HELLO_PART)

    newcomer, _ = _connect(factory, port=4)  # the part-hello one, though younger than the others
    assert newcomer is not None and partial_transport.disconnected
    assert not silent_transport.disconnected and not answered_transport.disconnected
    assert limiter.events["closed to admit a new one (a stalled unfinished handshake of its listener)"] == 1

    newcomer.write(b"server hello")
    assert _connect(factory, port=5)[0] is None  # nothing stalled yet
    clock.advance(HELLO_SECONDS)
    assert _connect(factory, port=6)[0] is not None and silent_transport.disconnected
    assert _connect(factory, port=7)[0] is None  # the one just admitted has its HELLO_SECONDS
    clock.advance(CLIENT_TURN_SECONDS - HELLO_SECONDS)
    assert _connect(factory, port=8)[0] is not None and answered_transport.disconnected  # oldest first
    assert not newcomer.transport.disconnected
    assert limiter.total == 3 and len(factory.unfinished) == 3


class _Port:
    """What the limiter asks of Twisted's listening port: reading (accepting) and its batch size."""

    connected = True
    disconnecting = False

    def __init__(self) -> None:
        self.reading = True
        self.numberAccepts = 100

    def stopReading(self) -> None:
        self.reading = False

    def startReading(self) -> None:
        self.reading = True


def test_at_the_bound_a_listener_stops_accepting_so_newcomers_wait_queued_not_refused(caplog):
    """A failover's survivor offered thousands of handshakes at once: at the bound it stops accepting,
    and the rest wait in the kernel's listen queue (no accept, no refusal: a refused agent spent as
    much CPU as a connected one, three refusals each in a failover of 6,166). A place freed (a head
    arrived, or a handshake ended) resumes accepting, as many as the places free in the next batch;
    stalled handshakes are closed by the sweep while paused, since no newcomer comes to replace them."""
    clock, limiter, factory = _site(request_class=Pending, max_handshakes=3, max_per_address=0)
    factory.port = port = _Port()
    first, _ = _connect(factory, port=1)
    second, second_transport = _connect(factory, port=2)
    assert port.reading
    third, _ = _connect(factory, port=3)
    assert not port.reading and factory.paused  # at the bound: the next ones wait in the queue
    for connection in (first, second, third):
        connection.write(b"server hello")

    clock.advance(2)
    first.dataReceived(HEAD)  # its handshake is over: one place
    assert port.reading and port.numberAccepts == 1
    fourth, _ = _connect(factory, port=4)
    assert not port.reading

    fourth.write(b"server hello")
    clock.advance(CLIENT_TURN_SECONDS - 3)
    assert not port.reading and not second_transport.disconnected  # nothing stalled yet
    clock.advance(1.5)  # the sweep: second and third stalled in the client's turn, fourth not yet
    assert (
        second_transport.disconnected and third.transport.disconnected and not fourth.transport.disconnected
    )
    assert port.reading and port.numberAccepts == 2
    assert "connections refused or closed: 2 closed to admit a new one (a stalled unfinished" in caplog.text
    assert "refused at accept" not in caplog.text

    # A batch already accepted past the bound: the extra one is refused, as without a port.
    _connect(factory, port=5), _connect(factory, port=6)
    assert not port.reading
    assert _connect(factory, port=7)[0] is None


def test_many_refused_at_the_bound_do_not_rescan_the_unfinished_each_time():
    """A flood of refused connections costs a comparison each until the first unfinished one may have
    stalled."""
    clock, limiter, factory = _site(request_class=Pending, max_handshakes=50, max_per_address=0)
    held = [_connect(factory, port=port)[0] for port in range(50)]
    for connection in held:
        connection.write(b"server hello")
    clock.advance(HELLO_SECONDS)  # when the first could have stalled had serve not answered it
    assert _connect(factory, port=100)[0] is None  # scanned once: none stalls before 5 s from its answer
    assert factory.first_stall == CLIENT_TURN_SECONDS
    factory.unfinished = _Exploding(factory.unfinished)
    assert all(_connect(factory, port=101 + n)[0] is None for n in range(100))


class _Exploding(dict):
    def __iter__(self):
        raise AssertionError("scanned")


def test_at_the_total_cap_the_longest_waiting_for_a_head_makes_room_and_nothing_else_does():
    clock, limiter, factory = _site(request_class=Pending, max_connections=3, max_per_address=0)
    oldest, oldest_transport = _connect(factory, port=1)
    clock.advance(1)
    busy, busy_transport = _connect(factory, port=2)
    busy.dataReceived(HEAD)
    clock.advance(1)
    waiting, waiting_transport = _connect(factory, port=3)

    newcomer, _ = _connect(factory, port=4)
    assert newcomer is not None and oldest_transport.disconnected
    assert not busy_transport.disconnected and not waiting_transport.disconnected
    newcomer.dataReceived(HEAD)
    waiting.dataReceived(HEAD)
    assert limiter.total == 3
    assert _connect(factory, port=5)[0] is None  # all three are being answered: nothing to close
    assert limiter.total == 3


def test_at_the_total_cap_a_websocket_too_young_to_have_authenticated_makes_room_and_an_older_one_does_not():
    clock, limiter, factory = _site(request_class=Pending, max_connections=2, max_per_address=0)
    upgrade = b"GET /agent/v1/stream HTTP/1.1\r\nHost: palisade\r\nUpgrade: websocket\r\n\r\n"
    settled, settled_transport = _connect(factory, port=1)
    settled.dataReceived(upgrade)
    clock.advance(20)
    young, young_transport = _connect(factory, port=2)
    young.dataReceived(upgrade)
    assert _connect(factory, port=3)[0] is not None
    assert young_transport.disconnected and not settled_transport.disconnected


def test_at_the_total_cap_the_slowest_body_makes_room_when_nothing_else_can():
    clock, limiter, factory = _site(request_class=Pending, max_connections=2, max_per_address=0)
    head = b"POST /agent/v1/flows HTTP/1.1\r\nHost: palisade\r\nContent-Length: 100000\r\n\r\n"
    slow, slow_transport = _connect(factory, port=1)
    fast, fast_transport = _connect(factory, port=2)
    slow.dataReceived(head)
    fast.dataReceived(head)
    clock.advance(2)
    slow.dataReceived(b"x" * 100)
    fast.dataReceived(b"x" * 50_000)
    assert _connect(factory, port=3)[0] is not None
    assert slow_transport.disconnected and not fast_transport.disconnected


def test_refusals_are_one_log_line_every_ten_seconds(caplog):
    clock, limiter, factory = _site(max_per_address=1)
    caplog.set_level(logging.WARNING, logger="palisade.serve")
    _connect(factory, port=1)
    for port in range(2, 500):
        _connect(factory, port=port)
    clock.advance(1)
    for port in range(500, 600):
        _connect(factory, port=port)
    clock.advance(5)

    def lines():
        return [r.getMessage() for r in caplog.records if "connections refused" in r.getMessage()]

    assert len(lines()) == 1 and "498 over the per-address cap of 1" in lines()[0]
    clock.advance(5)
    assert len(lines()) == 2 and "100 over the per-address cap of 1" in lines()[1]


def test_limits_come_from_the_flags_and_the_descriptor_budget():
    options = {
        "max_connections": None,
        "max_connections_per_address": 256,
        "request_head_timeout": 15.0,
        "request_body_min_rate": 1024.0,
    }
    assert limits_from_options(options, descriptors=1024, reserve=200).max_connections == 824
    assert (
        limits_from_options({**options, "max_connections": 50}, descriptors=1024, reserve=200).max_connections
        == 50
    )
    with pytest.raises(LimitsError, match="raise the limit"):
        limits_from_options(options, descriptors=128, reserve=200)
    with pytest.raises(LimitsError, match="--request-head-timeout"):
        limits_from_options({**options, "request_head_timeout": 0}, descriptors=1024, reserve=200)
    with pytest.raises(LimitsError, match="--max-connections-per-address"):
        limits_from_options({**options, "max_connections_per_address": -1}, descriptors=1024, reserve=200)


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one():
    script = "from controlplane.connection_limits import descriptor_limit_raise as r; print(*r())"
    result = subprocess.run(
        ["prlimit", "--nofile=512:2048", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.split() == ["512", "2048"]


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_slow_body_costs_no_descriptor_beside_its_connection_until_it_is_large():
    clock, limiter, factory = _site(request_class=Pending)
    connection, _ = _connect(factory)
    before = _descriptors()
    # Twisted gave a body declared at 100 KB or more a temporary file from its first byte.
    connection.dataReceived(
        b"POST /agent/v1/flows HTTP/1.1\r\nHost: palisade\r\nContent-Length: 30000000\r\n\r\n0123456789"
    )
    content = connection.wrappedProtocol.requests[-1].content
    assert isinstance(content, BodyFile) and _descriptors() == before
    connection.dataReceived(b"x" * SPOOL_BYTES)
    assert _descriptors() == before + 1 and BodyFile.spilled == 1
    connection.connectionLost(Failure(ConnectionDone()))  # a request with a body is told why
    assert _descriptors() == before and BodyFile.spilled == 0


def test_only_so_many_bodies_are_in_files_at_once(monkeypatch):
    monkeypatch.setattr("controlplane.http_limits.MAX_SPILLED_BODIES", 2)
    bodies = [BodyFile(max_size=10) for _ in range(3)]
    for body in bodies:
        body.write(b"x" * 20)
    assert [body._rolled for body in bodies] == [True, True, False] and BodyFile.spilled == 2
    bodies[0].close()
    bodies[2].write(b"y")
    assert bodies[2]._rolled and BodyFile.spilled == 2
    bodies[2].seek(0)
    assert bodies[2].read() == b"x" * 20 + b"y"
    for body in bodies:
        body.close()
    assert BodyFile.spilled == 0


def test_a_body_serve_holds_unread_while_it_checks_the_headers_is_not_cut_for_that_wait(monkeypatch):
    """The body gate reads nothing of a body until its headers check is done (for a flow report, a read
    of the database, which may wait): that time is serve's, not the client's, and its rate is counted
    from when serve reads again."""
    from concurrent.futures import Future

    from twisted.internet import reactor

    from controlplane import body_gate
    from controlplane.listeners import OPERATOR

    check_done: Future = Future()
    monkeypatch.setattr(body_gate, "listener_for_port", lambda port: OPERATOR)
    monkeypatch.setattr(body_gate, "operator_credential_check", lambda headers: None)
    monkeypatch.setattr(body_gate, "_run_check", lambda check, headers: check_done)
    monkeypatch.setattr(reactor, "callFromThread", lambda call, *args: call(*args))
    clock, limiter, factory = _site()
    connection, transport = _connect(factory)
    connection.dataReceived(
        b"POST /api/v1/services HTTP/1.1\r\nHost: palisade\r\nContent-Length: 5000\r\n\r\n" + b"x" * 100
    )
    assert connection.phase is Phase.BODY
    clock.advance(120)  # the check waits on the database for two minutes
    assert not transport.disconnected
    check_done.set_result(None)  # passed: serve reads the body from now on
    clock.advance(5)
    assert not transport.disconnected  # within the grace, counted from when serve read again
    clock.advance(10)
    assert transport.disconnected  # and then held to the minimum rate as any body


def test_a_connection_whose_client_stopped_waiting_in_the_listen_queue_is_seen_gone_at_accept():
    """A client queued behind a listener at its bound may give up before serve accepts it: its FIN (or
    its reset) came first, and serve would answer its ClientHello for nobody."""
    import socket

    from controlplane.connection_limits import peer_gone

    class Handle:
        def __init__(self, sock):
            self.sock = sock

        def getHandle(self):
            return self.sock

    with socket.create_server(("127.0.0.1", 0), backlog=8) as listener:
        waiting = socket.create_connection(listener.getsockname())
        gone = socket.create_connection(listener.getsockname())
        gone.sendall(HELLO_PART)
        gone.close()  # before serve accepted it
        kept, _ = listener.accept()
        closed, _ = listener.accept()
        try:
            assert not peer_gone(Handle(kept))
            assert peer_gone(Handle(closed))
            assert not peer_gone(StringTransport())  # no socket: nothing to tell
        finally:
            for sock in (waiting, kept, closed):
                sock.close()

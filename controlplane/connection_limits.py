"""serve's connection limits: how many connections it holds, for how long each may take to ask.

One unauthenticated client used to hold both listeners: a request head sent a byte every 20 seconds
never ended (each byte reset Twisted's idle timer), and with 1,024 descriptors about 1,000 such
connections left none for anyone else, nor for housekeeping's database. Here, below TLS, every
accepted socket is counted before any byte is read:

- at most `max_connections` at once over both listeners, below the descriptor limit with room kept for
  the database, Redis, log files and housekeeping (`descriptor_reserve`);
- at most `max_per_address` from one client address (an IPv4 address, or an IPv6 /64, which one
  subscriber usually holds whole) that have not yet shown what they are: a websocket that has lived
  past the gateway's handshake time (an agent's authenticated stream) no longer counts there, so a
  fleet behind one NAT address or a TCP load balancer is not held to the cap; a connection over either
  cap is closed as soon as it is accepted;
- at most `max_handshakes` connections per listener that have not yet sent their first request head
  (the TLS handshake, then the head: for an agent, its websocket upgrade). At that bound a new
  connection is refused as it is accepted (closed before any TLS) while every unfinished one is
  progressing, and admitted in place of the oldest stalled one otherwise. Stalled: a connection that
  has sent part of a TLS ClientHello and stopped (serve had nothing to answer yet), one that sent
  nothing within `HELLO_SECONDS` of its accept, or one that has not sent its request head within
  `CLIENT_TURN_SECONDS` of serve's answer to its hello. Offered more handshakes than it finished
  (thousands of agents arriving at once after a failover), serve used to close the oldest every time,
  each one just before it would have finished: a survivor closed 43,457 handshakes while 5,895 agents
  took 493 s to reconnect. Refusing the new one instead let the handshakes admitted finish, but each
  refused agent came back after its backoff, again and again (20,391 refusals for 6,166 agents),
  each time costing it about what a reconnection does. So at the bound the listener stops accepting
  (its port stops reading) until a place frees, and the next clients wait in the kernel's listen
  queue, accepted in turn, as many at a time as places are free; only the rest of a batch Twisted
  accepted together is refused. Anyone holding many slow handshakes still shuts nobody out: theirs
  stall and are closed for newcomers, or by the sweep while the listener is not accepting; what such
  a client must do instead is keep every handshake moving (a full ClientHello each, serve's handshake
  work) and renew them faster than `CLIENT_TURN_SECONDS`;
- when the total is reached, the connection that has waited longest for a request head is closed to
  admit the new one: a connection that is still in its TLS handshake, still sending its head, or idle
  between keep-alive requests costs the server a descriptor and gives it nothing; failing that, a
  websocket too young to have authenticated, and then the slowest request body;
- a request head must be complete `head_timeout` seconds after the connection is ready for it (accept,
  which includes the TLS handshake, or the end of the previous response on a kept-alive connection),
  unless the client is still reading that response at the minimum rate;
- a request body must arrive at `body_min_rate` bytes a second on average after a grace of
  `BODY_GRACE_SECONDS`, counted from when the body gate (controlplane/body_gate.py) admits it, and not
  counting the time serve itself holds the body unread (the gate's check of a flow report's headers,
  which waits on the database): a client is not cut for serve's wait. The gate may ask a faster pace of
  a body (`LimitedConnection.body_admitted`): the gateway's bodies keep
  `PALISADE_GATEWAY_BODY_MIN_RATE`, so a body of declared length L is complete within the grace plus
  L at that rate, and one of unknown length (chunked) is never further behind it than the grace.

Requests being answered and websockets (once upgraded: the gateway's consumer closes a stream that does
not authenticate within its own handshake time) have no deadline here. The HTTP channel
(controlplane/http_limits.py) tells its connection where the request is; a channel without a
`LimitedConnection` under it is simply not limited.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import os
import resource
import socket
from collections import Counter
from dataclasses import dataclass

from twisted.protocols.policies import ProtocolWrapper, WrappingFactory

log = logging.getLogger("palisade.serve")

BODY_GRACE_SECONDS = 10.0
SWEEP_EVERY_SECONDS = 1.0
LOG_EVERY_SECONDS = 10.0
# stdio, the two listening sockets, the event loop's epoll and self-pipe, log files, certificate and
# key reads, /dev/urandom, and modules imported late.
BASE_RESERVE = 64
# A database connection per thread that may hold one: one socket on PostgreSQL, up to three files on
# SQLite (the database, its WAL and its shared-memory index).
DESCRIPTORS_PER_DATABASE_THREAD = 3
# A websocket this young may not have authenticated yet (the gateway allows 10 s, fleet/gateway.py):
# at the total cap it may be closed for room, after connections waiting for a head. Older ones never are.
YOUNG_STREAM_SECONDS = 15.0
# Request bodies held in temporary files at once (controlplane/http_limits.py); the rest wait in memory.
MAX_SPILLED_BODIES = 64
DEFAULT_PER_ADDRESS = 256
DEFAULT_HEAD_TIMEOUT = 15.0
DEFAULT_BODY_MIN_RATE = 1024
# serve's work for a handshake and an upgrade is a few milliseconds: 256 is over a second of it queued.
DEFAULT_MAX_HANDSHAKES = 256
# A client sends its ClientHello with the connection: one that has sent nothing this long after its
# accept is stalled (its bytes may wait a moment in the kernel while serve's loop is busy).
HELLO_SECONDS = 2.0
# After serve answered the hello, the client's Finished and its request head: stalled past this. A
# simulated agent on a starved core takes seconds here; the real agent gives up after 10 s.
CLIENT_TURN_SECONDS = 5.0


class Phase(enum.Enum):
    HEAD = "waiting for a request head"  # deadline; the oldest is closed when the total is reached
    BODY = "receiving a request body"  # minimum rate
    BUSY = "being answered"
    STREAM = "websocket"


@dataclass(frozen=True)
class Limits:
    max_connections: int
    max_per_address: int  # 0: no per-address cap
    head_timeout: float
    body_min_rate: float
    body_grace: float = BODY_GRACE_SECONDS
    max_handshakes: int = 0  # per listener, connections before their first request head; 0: no bound


def descriptor_limit_raise() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one; (soft before, soft now). Descriptors above 1,024
    are safe here: the event loop uses epoll, not select."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as error:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, error)
            return soft, soft
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def database_threads() -> int:
    """Threads of serve that may each hold a database connection. A heavy worker keeps its database in
    its own process and costs serve one socket: it is counted as a thread, generously."""
    from django.conf import settings
    from twisted.internet import reactor

    from controlplane import http_threads
    from controlplane.body_gate import HEADER_CHECK_THREADS
    from fleet.held_streams import DB_THREADS

    reactor_pool = reactor.getThreadPool().max  # housekeeping and shutdown's deferToThread
    # asyncio's default executor (daphne sizes it from ASGI_THREADS when set), then Channels' own thread
    loop_executor = int(os.environ.get("ASGI_THREADS") or min(32, (os.cpu_count() or 1) + 4))
    return (
        http_threads.POOL_THREADS
        + settings.PALISADE_HEAVY_WORKERS
        + http_threads.FLOW_REPORT_THREADS
        + DB_THREADS
        + settings.PALISADE_WEBHOOK_SENDER_THREADS  # each also holds a receiver's socket
        + reactor_pool
        + loop_executor
        + 1  # Channels' database thread
        + HEADER_CHECK_THREADS
        + 1  # the credential watch (controlplane/credential_watch.py), on PostgreSQL
    )


def redis_connections() -> int:
    """The channel layer's Redis pool, when several serve processes share one."""
    from django.conf import settings

    from controlplane.channel_layer import POOL_SIZE

    backend = settings.CHANNEL_LAYERS.get("default", {}).get("BACKEND", "")
    return POOL_SIZE if "Redis" in backend else 0


def descriptor_reserve(*, database_threads: int, redis_connections: int) -> int:
    """Descriptors kept out of the connection cap."""
    return (
        BASE_RESERVE
        + DESCRIPTORS_PER_DATABASE_THREAD * database_threads
        + redis_connections
        + MAX_SPILLED_BODIES
    )


def add_arguments(parser) -> None:
    """serve's flags for the limits; each defaults to an environment variable, then to the default."""
    env = os.environ.get
    parser.add_argument(
        "--max-connections",
        type=int,
        default=env("PALISADE_MAX_CONNECTIONS"),
        metavar="N",
        help="connections held at once over both listeners (default: the open-file limit less a reserve)",
    )
    parser.add_argument(
        "--max-connections-per-address",
        type=int,
        default=env("PALISADE_MAX_CONNECTIONS_PER_ADDRESS", DEFAULT_PER_ADDRESS),
        metavar="N",
        help=f"connections from one IPv4 address or IPv6 /64 (default {DEFAULT_PER_ADDRESS}; 0: no cap)",
    )
    parser.add_argument(
        "--max-handshakes",
        type=int,
        default=env("PALISADE_MAX_HANDSHAKES", DEFAULT_MAX_HANDSHAKES),
        metavar="N",
        help=(
            "connections per listener still in their TLS handshake or first request head; at the bound "
            "a new one is refused while they all progress, else admitted for the oldest stalled one "
            f"(default {DEFAULT_MAX_HANDSHAKES}; 0: no bound)"
        ),
    )
    parser.add_argument(
        "--request-head-timeout",
        type=float,
        default=env("PALISADE_REQUEST_HEAD_TIMEOUT", DEFAULT_HEAD_TIMEOUT),
        metavar="SECONDS",
        help=(
            "from accepting a connection (TLS handshake included), or the end of the previous response, "
            f"to the end of a request head (default {DEFAULT_HEAD_TIMEOUT:g})"
        ),
    )
    parser.add_argument(
        "--request-body-min-rate",
        type=float,
        default=env("PALISADE_REQUEST_BODY_MIN_RATE", DEFAULT_BODY_MIN_RATE),
        metavar="BYTES",
        help=(
            f"bytes a second a request body must average after {BODY_GRACE_SECONDS:g} s "
            f"(default {DEFAULT_BODY_MIN_RATE}; 0: no minimum)"
        ),
    )


class LimitsError(ValueError):
    """A flag's value that cannot be used; the message names the flag."""


def limits_from_options(options: dict, *, descriptors: int, reserve: int) -> Limits:
    """The limits serve runs with, from its flags (already defaulted from the environment)."""
    budget = descriptors - reserve
    try:
        max_connections = int(
            options["max_connections"] if options["max_connections"] is not None else budget
        )
        per_address = int(options["max_connections_per_address"])
        max_handshakes = int(options.get("max_handshakes") or 0)
        head_timeout = float(options["request_head_timeout"])
        body_min_rate = float(options["request_body_min_rate"])
    except ValueError as error:
        raise LimitsError(f"a connection limit is not a number: {error}") from None
    if max_connections < 1:
        raise LimitsError(
            f"--max-connections must be at least 1; the open-file limit ({descriptors}) less the "
            f"reserve ({reserve}) leaves {budget}: raise the limit (LimitNOFILE, ulimit -n)"
        )
    if per_address < 0:
        raise LimitsError("--max-connections-per-address must be 0 (no cap) or more")
    if max_handshakes < 0:
        raise LimitsError("--max-handshakes must be 0 (no bound) or more")
    if not 0 < head_timeout <= 3600:
        raise LimitsError("--request-head-timeout must be more than 0 and at most 3600 seconds")
    if body_min_rate < 0:
        raise LimitsError("--request-body-min-rate must be 0 (no minimum) or more")
    if max_connections > budget:
        log.warning(
            "--max-connections %d is above the %d the open-file limit allows (%d less a reserve of %d): "
            "when descriptors run out, the database and housekeeping fail first",
            max_connections,
            max(budget, 0),
            descriptors,
            reserve,
        )
    return Limits(max_connections, per_address, head_timeout, body_min_rate, max_handshakes=max_handshakes)


def serve_limits(options: dict) -> Limits:
    """At serve's start: the soft open-file limit raised to the hard one, and the limits it allows."""
    before, descriptors = descriptor_limit_raise()
    threads = database_threads()
    reserve = descriptor_reserve(database_threads=threads, redis_connections=redis_connections())
    limits = limits_from_options(options, descriptors=descriptors, reserve=reserve)
    log.info(
        "open-file limit %d%s; connections: at most %d (%d kept for %d database threads and the rest), "
        "%s per address, %s handshakes per listener; a request head within %g s, a body at %s",
        descriptors,
        f" (raised from {before})" if before != descriptors else "",
        limits.max_connections,
        reserve,
        threads,
        limits.max_per_address or "no cap",
        limits.max_handshakes or "any",
        limits.head_timeout,
        f"{limits.body_min_rate:g} bytes/s" if limits.body_min_rate else "any rate",
    )
    return limits


def _unsent(transport) -> int:
    """Bytes a TCP transport holds that the kernel has not taken yet (twisted's FileDescriptor)."""
    buffered = getattr(transport, "dataBuffer", b"")
    return len(buffered) - getattr(transport, "offset", 0) + getattr(transport, "_tempDataLen", 0)


# Linux's TCP states (include/net/tcp_states.h): the peer sent its FIN, or reset the connection.
TCP_CLOSE, TCP_CLOSE_WAIT = 7, 8


def peer_gone(transport) -> bool:
    """Whether the client of a just-accepted connection has already closed or reset it: one
    getsockopt, no read."""
    try:
        state = transport.getHandle().getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except (AttributeError, OSError, IndexError):  # not a TCP socket (tests), or already closed
        return False
    return state in (TCP_CLOSE, TCP_CLOSE_WAIT)


def address_key(host: str) -> str:
    """Whom a connection counts against: an IPv4 address (also when a dual-stack listener shows it as
    ::ffff:a.b.c.d), or an IPv6 /64."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class LimitedConnection(ProtocolWrapper):
    """One accepted socket, under TLS. Its phase and deadline are set by the limiter and the channel."""

    factory: LimitingFactory

    def __init__(self, factory: LimitingFactory, wrapped, key: str):
        super().__init__(factory, wrapped)
        self.key = key
        self.phase = Phase.HEAD
        self.deadline = 0.0
        self.body_started = 0.0
        self.body_bytes = 0
        self.body_rate = 0.0  # a pace the body gate set for this body, above the limiter's minimum
        self.held_at: float | None = None  # serve reads nothing of the body since then
        self.unsent = 0  # bytes of the answers the socket still had to send, and when
        self.unsent_at = 0.0
        self.counted = True  # until released: closed, or evicted (its socket closes a moment later)
        self.addressed = True  # counted against its address's cap: until released, or a settled stream
        self.answered = False  # serve has written to it (its answer to the ClientHello)
        self.stalls_at = 0.0  # unfinished: when it counts as stalled (see ConnectionLimiter.admit)

    def makeConnection(self, transport):
        self.factory.limiter.admitted(self)
        super().makeConnection(transport)
        if peer_gone(transport):
            # It waited in the listen queue longer than its client did: its ClientHello is read,
            # but answering it (serve's share of a handshake) would be for nobody.
            self.factory.limiter.events["closed as accepted (its client had stopped waiting)"] += 1
            self.factory.limiter.released(self)
            self.cut()

    def dataReceived(self, data):
        if self.phase is Phase.BODY:
            self.body_bytes += len(data)  # TLS records: a few percent over the body itself
        super().dataReceived(data)
        if not self.answered and self.counted:
            # TLS read it all and had nothing to say: a ClientHello in pieces, the rest not sent.
            self.factory.limiter.stalled(self)

    def write(self, data):
        if not self.answered:
            self.factory.limiter.answered(self)
        super().write(data)

    def writeSequence(self, data):
        if not self.answered:
            self.factory.limiter.answered(self)
        super().writeSequence(data)

    def connectionLost(self, reason):
        self.factory.limiter.released(self)
        super().connectionLost(reason)

    # What the HTTP channel reports.

    def head_received(self) -> None:
        self.factory.limiter.enter(self, Phase.BODY)

    def body_admitted(self, rate: float) -> None:
        """The body gate admitted the body: its clock starts now (it was not read while its headers were
        checked), at `rate` bytes a second at least, or the limiter's minimum if that is faster."""
        self.factory.limiter.pace(self, rate)

    def body_held(self) -> None:
        """serve stops reading the body (it checks the headers first): its rate is not counted."""
        self.factory.limiter.hold(self)

    def body_resumed(self) -> None:
        self.factory.limiter.resume(self)

    def content_received(self, *, upgrade: bool) -> None:
        self.factory.limiter.enter(self, Phase.STREAM if upgrade else Phase.BUSY)

    def response_done(self) -> None:
        self.factory.limiter.enter(self, Phase.HEAD)

    def cut(self) -> None:
        self.transport.abortConnection()  # the descriptor is freed now, whatever the peer does


class LimitingFactory(WrappingFactory):
    """Wraps a listening port's factory (the TLS one): a connection over a cap is never built, and
    Twisted closes its socket at once."""

    protocol = LimitedConnection

    def __init__(self, wrapped, limiter: ConnectionLimiter, name: str = ""):
        from controlplane.metrics import HANDSHAKES_CLOSED, HANDSHAKES_REFUSED

        super().__init__(wrapped)
        self.limiter = limiter
        # This listener's connections that have not sent their first request head, oldest first.
        self.unfinished: dict[LimitedConnection, None] = {}
        # No unfinished connection stalls before this (a lower bound: rescanned when reached).
        self.first_stall = float("inf")
        self.closed_stalled = HANDSHAKES_CLOSED.labels(listener=name)
        self.refused_new = HANDSHAKES_REFUSED.labels(listener=name)
        self.port = None  # the listening port, once installed: accepting pauses at the bound
        self.paused = False
        limiter.listeners.append(self)

    def accepting_pause(self) -> None:
        """Accept nothing more until a place frees: the next clients wait in the kernel's listen queue,
        at no cost to serve or to them, instead of being accepted only to be refused."""
        if self.port is not None and not self.paused:
            self.paused = True
            self.port.stopReading()

    def accepting_resume(self, free: int) -> None:
        """Accept again, at most `free` connections in the next batch: the places free now."""
        port = self.port
        if not self.paused or free <= 0 or port is None:
            return
        self.paused = False
        if getattr(port, "disconnecting", False) or not getattr(port, "connected", True):
            return  # stopped listening (serve is stopping): nothing to resume
        port.numberAccepts = free  # Twisted's batch per readable event; it grows again by itself
        port.startReading()

    def buildProtocol(self, addr):
        key = address_key(getattr(addr, "host", ""))
        if not self.limiter.admit(key, self):
            return None
        wrapped = self.wrappedFactory.buildProtocol(addr)
        if wrapped is None:
            return None
        return self.protocol(self, wrapped, key)

    def registerProtocol(self, p):  # WrappingFactory keeps a dict of its own; the limiter counts
        pass

    def unregisterProtocol(self, p):
        pass


class ConnectionLimiter:
    def __init__(self, limits: Limits, clock=None):
        if clock is None:
            from twisted.internet import reactor as clock
        self.limits = limits
        self.clock = clock
        self.total = 0
        self.by_address: Counter[str] = Counter()
        self.waiting: dict[LimitedConnection, None] = {}  # in HEAD, oldest first
        self.receiving: dict[LimitedConnection, None] = {}  # in BODY
        self.young_streams: dict[LimitedConnection, None] = {}  # upgraded less than 15 s ago, oldest first
        self.listeners: list[LimitingFactory] = []
        self.events: Counter[str] = Counter()
        self.logged_at = -LOG_EVERY_SECONDS
        self._sweep = None

    def install(self, port) -> None:
        """Wrap a listening port's factory: called when it listens, before the reactor runs, so before
        any connection is accepted."""
        from controlplane.listeners import listener_for_port

        factory = LimitingFactory(port.factory, self, listener_for_port(port.getHost().port))
        factory.port = port
        port.factory = factory

    def start(self) -> None:
        from twisted.internet.task import LoopingCall

        self._sweep = LoopingCall(self.sweep)
        self._sweep.clock = self.clock
        self._sweep.start(SWEEP_EVERY_SECONDS, now=False)

    def admit(self, key: str, listener: LimitingFactory | None = None) -> bool:
        per_address = self.limits.max_per_address
        if per_address and self.by_address[key] >= per_address:
            self.events[f"over the per-address cap of {per_address}"] += 1
            return False
        bound = self.limits.max_handshakes
        if bound and listener is not None and len(listener.unfinished) >= bound:
            stalled = self._stalled(listener)
            if stalled is None:
                self.events["refused at accept (its listener's unfinished handshakes all progressing)"] += 1
                listener.refused_new.inc()
                listener.accepting_pause()  # one of a batch accepted together: the rest wait queued
                return False
            self._stalled_close(listener, stalled)
        if self.total >= self.limits.max_connections:
            if self.waiting:
                oldest = next(iter(self.waiting))
                self.events["closed to admit a new one (the longest waiting for a request head)"] += 1
            elif self.young_streams:
                oldest = next(iter(self.young_streams))
                self.events["closed to admit a new one (a websocket too young to have authenticated)"] += 1
            elif self.receiving:
                now = self.clock.seconds()
                oldest = min(self.receiving, key=lambda c: c.body_bytes / max(now - c.body_started, 1.0))
                self.events["closed to admit a new one (the slowest request body)"] += 1
            else:
                self.events[f"over the total cap of {self.limits.max_connections}"] += 1
                return False
            self.released(oldest)
            oldest.cut()
        return True

    def _stalled(self, listener: LimitingFactory) -> LimitedConnection | None:
        """The oldest of the listener's unfinished connections that has stalled, if one has. Scanned
        only once the earliest time one may stall has come: a flood of refused connections costs a
        comparison each."""
        now = self.clock.seconds()
        if now < listener.first_stall:
            return None
        first = float("inf")
        for connection in listener.unfinished:
            if connection.stalls_at <= now:
                return connection
            first = min(first, connection.stalls_at)
        listener.first_stall = first
        return None

    def _stalled_close(self, listener: LimitingFactory, connection: LimitedConnection) -> None:
        self.events["closed to admit a new one (a stalled unfinished handshake of its listener)"] += 1
        listener.closed_stalled.inc()
        self.released(connection)
        connection.cut()

    def _stalled_close_all(self, listener: LimitingFactory, now: float) -> None:
        """Accepting paused, no newcomer is offered to take a stalled one's place: every stalled
        unfinished connection is closed here, and the queue fills their places at once."""
        stalled = [connection for connection in listener.unfinished if connection.stalls_at <= now]
        for connection in stalled:
            listener.unfinished.pop(connection)  # all out first: accepting resumes once, for them all
        for connection in stalled:
            self._stalled_close(listener, connection)

    def admitted(self, connection: LimitedConnection) -> None:
        self.total += 1
        self.by_address[connection.key] += 1
        connection.stalls_at = self.clock.seconds() + HELLO_SECONDS
        listener = connection.factory
        listener.unfinished[connection] = None
        listener.first_stall = min(listener.first_stall, connection.stalls_at)
        if self.limits.max_handshakes and len(listener.unfinished) >= self.limits.max_handshakes:
            listener.accepting_pause()
        self.enter(connection, Phase.HEAD)

    def answered(self, connection: LimitedConnection) -> None:
        """serve wrote its first bytes (the answer to a whole ClientHello): the client's turn."""
        connection.answered = True
        connection.stalls_at = self.clock.seconds() + CLIENT_TURN_SECONDS  # later: first_stall holds

    def stalled(self, connection: LimitedConnection) -> None:
        """Bytes came and serve had no answer to them: part of a ClientHello, the rest withheld."""
        listener = connection.factory
        if connection in listener.unfinished:
            connection.stalls_at = now = self.clock.seconds()
            listener.first_stall = min(listener.first_stall, now)

    def released(self, connection: LimitedConnection) -> None:
        if not connection.counted:
            return
        connection.counted = False
        self.total -= 1
        self._unaddress(connection)
        self.waiting.pop(connection, None)
        self.receiving.pop(connection, None)
        self.young_streams.pop(connection, None)
        self._finished(connection)

    def _finished(self, connection: LimitedConnection) -> None:
        """`connection` no longer counts as unfinished: its place goes to the next in the queue."""
        listener = connection.factory
        listener.unfinished.pop(connection, None)
        if listener.paused:
            listener.accepting_resume(self.limits.max_handshakes - len(listener.unfinished))

    def _unaddress(self, connection: LimitedConnection) -> None:
        if not connection.addressed:
            return
        connection.addressed = False
        self.by_address[connection.key] -= 1
        if not self.by_address[connection.key]:
            del self.by_address[connection.key]

    def hold(self, connection: LimitedConnection) -> None:
        """A body serve has stopped reading: off the minimum rate until `resume`."""
        if connection.counted and connection.phase is Phase.BODY and connection.held_at is None:
            self.receiving.pop(connection, None)
            connection.held_at = self.clock.seconds()

    def resume(self, connection: LimitedConnection) -> None:
        """The body is read again: its rate is counted as if the held time had not passed."""
        if connection.counted and connection.phase is Phase.BODY and connection.held_at is not None:
            connection.body_started += self.clock.seconds() - connection.held_at
            connection.held_at = None
            self.receiving[connection] = None

    def enter(self, connection: LimitedConnection, phase: Phase) -> None:
        if not connection.counted:
            return
        connection.held_at = None
        now = self.clock.seconds()
        self.waiting.pop(connection, None)
        self.receiving.pop(connection, None)
        self.young_streams.pop(connection, None)
        if phase is not Phase.HEAD:  # a head arrived: its handshake is over (later heads never count)
            self._finished(connection)
        connection.phase = phase
        if phase is Phase.HEAD:
            connection.deadline = now + self.limits.head_timeout
            connection.unsent, connection.unsent_at = _unsent(connection.transport), now
            self.waiting[connection] = None
        elif phase is Phase.BODY:
            connection.body_started = now
            connection.body_bytes = 0
            connection.body_rate = 0.0
            self.receiving[connection] = None
        elif phase is Phase.STREAM:
            connection.deadline = now + YOUNG_STREAM_SECONDS  # from then on, never closed for room
            self.young_streams[connection] = None

    def pace(self, connection: LimitedConnection, rate: float) -> None:
        if connection.phase is not Phase.BODY or not connection.counted:
            return
        connection.body_started = self.clock.seconds()
        connection.body_bytes = 0
        connection.body_rate = rate

    def still_reading(self, connection: LimitedConnection, now: float) -> bool:
        """A client still reading the previous answer at the minimum rate: its deadline waits (a large
        answer to a slow client); one that stopped reading does not."""
        unsent = _unsent(connection.transport)
        drained = (connection.unsent - unsent) / max(now - connection.unsent_at, SWEEP_EVERY_SECONDS)
        connection.unsent, connection.unsent_at = unsent, now
        return unsent > 0 and drained >= max(self.limits.body_min_rate, 1)

    def body_rate(self, connection: LimitedConnection) -> float:
        return max(self.limits.body_min_rate, connection.body_rate)

    def body_deadline(self, connection: LimitedConnection) -> float:
        """The grace, then a second more for every `rate` bytes received: a body of declared length L is
        complete by its start + grace + L / rate at the latest."""
        rate = self.body_rate(connection)
        if rate <= 0:
            return float("inf")
        return connection.body_started + self.limits.body_grace + connection.body_bytes / rate

    def sweep(self) -> None:
        now = self.clock.seconds()
        for listener in self.listeners:
            if listener.paused and now >= listener.first_stall:
                self._stalled_close_all(listener, now)
        for connection in [c for c in self.waiting if c.deadline < now]:
            if self.still_reading(connection, now):
                connection.deadline = now + SWEEP_EVERY_SECONDS
                continue
            self.released(connection)
            connection.cut()
            self.events[f"no request head within {self.limits.head_timeout:g} s"] += 1
        while self.young_streams:
            oldest = next(iter(self.young_streams))
            if oldest.deadline >= now:
                break
            del self.young_streams[oldest]
            self._unaddress(oldest)  # an agent's stream, past its handshake: the address cap is for the rest
        for connection in [c for c in self.receiving if self.body_deadline(c) < now]:
            self.released(connection)
            connection.cut()
            self.events[f"a request body slower than {self.body_rate(connection):g} bytes/s"] += 1
        if self.events and now - self.logged_at >= LOG_EVERY_SECONDS:
            self.log_events(now)

    def log_events(self, now: float) -> None:
        """One line for everything refused or closed since the last one, at most every 10 seconds."""
        self.logged_at = now
        counts = ", ".join(f"{count} {why}" for why, count in self.events.most_common())
        self.events.clear()
        log.warning(
            "connections refused or closed: %s (%d open of at most %d, %d from the busiest address)",
            counts,
            self.total,
            self.limits.max_connections,
            max(self.by_address.values(), default=0),
        )

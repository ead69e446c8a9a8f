"""The NFLOG flow source: connection attempts the owned table dropped (`blocked`).

A dropped packet never becomes a conntrack entry, so blocked attempts are only seen here, on the NFLOG
group the renderer logs drops to (policy/renderer.py, NFLOG_GROUP_BLOCKED). Each logged packet is one
packet, not one connection: SYN retransmits and repeated datagrams of one attempt share their 5-tuple,
so an attempt counts once until its 5-tuple has been quiet for `ATTEMPT_SECONDS`. Would-block
connections are admitted and marked, so the conntrack source counts them; this source does not bind
the would-block group, and nothing is counted twice.

The direction of a drop is in the log prefix the renderer gives its rule (docs/flows.md, "NFLOG
prefixes"): `palisade:out` for an outgoing connection this workload attempted (the peer is then the
packet's destination), `palisade:in` or no prefix at all (what inbound rules have always logged) for an
incoming one (the peer is the packet's source). Either may end in `:<rule number>` for a rule that
decided the drop; the port is the destination's both ways. A prefix of any other form is read as
inbound without a rule, so that an unknown renderer's drops are still counted.

Only one socket can bind a group: a stale process holding it makes `subscribe` fail with EPERM.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from agent.conntrack import PROTOCOL_NAMES
from agent.flowwindow import INBOUND, OUTBOUND, FlowKey, Gap, Windows
from agent.netlink import Datagrams, attributes_of, drain_queued, is_overrun, latest, netlink_socket

NFLOG_GROUP_BLOCKED = 7302  # policy/renderer.py; tests/agent keeps the two equal
NFNL_SUBSYS_ULOG = 4
NFULNL_MSG_PACKET, NFULNL_MSG_CONFIG = 0, 1
NFULA_CFG_CMD, NFULA_CFG_MODE = 1, 2
NFULNL_CFG_CMD_BIND = 1
NFULNL_COPY_PACKET = 2
NFULA_PAYLOAD, NFULA_PREFIX = 9, 10
# The log prefixes of the blocked group: `palisade:<in|out>[:<rule number>]` (docs/flows.md).
PREFIX_INBOUND, PREFIX_OUTBOUND = "palisade:in", "palisade:out"
MAX_RULE_NUMBER = (1 << 24) - 1
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 2
COPY_BYTES = 128  # the IP and transport headers are all this source reads
ATTEMPT_SECONDS = 130.0  # TCP gives up a connect after about 127 s of SYN retransmits
MAX_ATTEMPTS_TRACKED = 200_000


def _config_message(group: int, attribute: int, value: bytes) -> bytes:
    attr = struct.pack("=HH", 4 + len(value), attribute) + value + b"\0" * (-len(value) % 4)
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(group)) + attr
    header = struct.pack(
        "=IHHII", 16 + len(body), (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, 1, 0
    )
    return header + body


def _acknowledged(sock: socket.socket) -> None:
    data = sock.recv(65536)
    if len(data) >= 20 and struct.unpack_from("=H", data, 4)[0] == NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, 16)[0]
        if code:
            raise OSError(code, f"NFLOG group {NFLOG_GROUP_BLOCKED}: {errno.errorcode.get(code, code)}")


def nflog_socket(buffer_bytes: int, group: int = NFLOG_GROUP_BLOCKED) -> socket.socket:
    sock = netlink_socket(0, buffer_bytes)
    try:
        sock.send(_config_message(group, NFULA_CFG_CMD, bytes([NFULNL_CFG_CMD_BIND])))
        _acknowledged(sock)
        sock.send(
            _config_message(group, NFULA_CFG_MODE, struct.pack(">IBB", COPY_BYTES, NFULNL_COPY_PACKET, 0))
        )
        _acknowledged(sock)
    except BaseException:
        sock.close()
        raise
    return sock


def packet_tuple(payload: bytes) -> tuple[str, str, int, str, int] | None:
    """(source, destination, protocol number, protocol name, destination port) of an IP packet."""
    if not payload:
        return None
    version = payload[0] >> 4
    if version == 4 and len(payload) >= 20:
        header = (payload[0] & 0x0F) * 4
        protocol = payload[9]
        source, destination = (
            str(ipaddress.IPv4Address(payload[12:16])),
            str(ipaddress.IPv4Address(payload[16:20])),
        )
        l4 = payload[header:]
    elif version == 6 and len(payload) >= 40:
        protocol = payload[6]
        source, destination = (
            str(ipaddress.IPv6Address(payload[8:24])),
            str(ipaddress.IPv6Address(payload[24:40])),
        )
        l4 = payload[40:]
    else:
        return None
    sport = dport = 0
    if protocol in (6, 17) and len(l4) >= 4:
        sport, dport = struct.unpack_from(">HH", l4)
    name = PROTOCOL_NAMES.get(protocol, str(protocol))
    return f"{source}|{sport}", destination, protocol, name, dport


def parse_packets(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(payload, prefix) of each logged packet; the prefix without its terminating NUL, empty if none."""
    offset = 0
    while offset + 16 <= len(data):
        length, message_type = struct.unpack_from("=IH", data, offset)
        if length < 16:
            break
        if message_type == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET:
            attributes = attributes_of(data[offset + 16 : offset + length], 4)
            payload = attributes.get(NFULA_PAYLOAD)
            if payload:
                yield payload, attributes.get(NFULA_PREFIX, b"").split(b"\0", 1)[0]
        offset += (length + 3) & ~3


def parse_prefix(prefix: bytes) -> tuple[str, int | None]:
    """(direction, rule number) a blocked drop's log prefix says: `palisade:out[:N]` is outbound,
    anything else inbound; a rule number only where it is one (1 to 2^24 - 1)."""
    text = prefix.decode("ascii", "replace")
    head, _, rule = text.partition(":")
    direction_word, _, rule = rule.partition(":")
    if head != "palisade" or direction_word not in ("in", "out"):
        return INBOUND, None
    number = int(rule) if rule.isascii() and rule.isdigit() and len(rule) <= 8 else 0
    return (OUTBOUND if direction_word == "out" else INBOUND), (
        number if 0 < number <= MAX_RULE_NUMBER else None
    )


class BlockedCounter:
    """One `blocked` connection per attempt: a 5-tuple counts again only after a quiet spell."""

    def __init__(self, windows: Windows):
        self.windows = windows
        self.attempts: OrderedDict[tuple, float] = OrderedDict()
        self.last_packet_at: float | None = None
        self.overruns = 0
        self.events_read = 0  # logged packets

    def packet(self, payload: bytes, at: float, prefix: bytes = b"") -> None:
        self.last_packet_at = at
        self.events_read += 1
        found = packet_tuple(payload)
        if found is None:
            return
        source_and_port, destination, protocol, name, dport = found
        attempt = (source_and_port, destination, protocol, dport)
        seen = self.attempts.pop(attempt, None)
        self.attempts[attempt] = at
        while len(self.attempts) > MAX_ATTEMPTS_TRACKED:
            self.attempts.popitem(last=False)
        if seen is not None and at - seen <= ATTEMPT_SECONDS:
            return  # a retransmit, or another datagram of the same attempt
        direction, rule = parse_prefix(prefix) if prefix else (INBOUND, None)
        if direction == OUTBOUND:
            key = FlowKey(destination, name, dport, "blocked", rule, OUTBOUND)
        else:
            key = FlowKey(source_and_port.split("|")[0], name, dport, "blocked", rule)
        self.windows.connection_opened(key, at)

    def overrun(self, *, since: float | None, at: float) -> Gap:
        """Packets were lost between `since` (the last one read before the failure) and `at`."""
        self.overruns += 1
        return Gap(
            "source_overrun", "nflog", since if since is not None and since < at else at - 0.001, at, {}
        )


class NflogSource:
    def __init__(self, windows: Windows, *, buffer_bytes: int, clock: Callable[[], float] = time.time):
        self.counter = BlockedCounter(windows)
        self.buffer_bytes = buffer_bytes
        self.clock = clock
        self.gaps: list[Gap] = []
        self.sock: socket.socket | None = None
        self.subscribed_at: float | None = None

    def subscribe(self) -> None:
        self.sock = nflog_socket(self.buffer_bytes)
        self.datagrams = Datagrams(self.sock)
        self.subscribed_at = self.clock()

    def read_once(self, timeout: float) -> int:
        if self.sock is None:
            raise RuntimeError("subscribe before reading packets")
        try:
            batch = self.datagrams.next(timeout)
        except OSError as error:
            if not is_overrun(error):
                raise
            # Lost since the last packet read, or since the subscription if none was read since.
            since = latest(self.counter.last_packet_at, self.subscribed_at)
            drain_queued(self.datagrams, self._packets)  # until then, further drops go unreported
            self.gaps.append(self.counter.overrun(since=since, at=self.clock()))
            return 0
        return sum(self._packets(data) for data in batch)

    def _packets(self, data: bytes) -> int:
        now = self.clock()
        packets = list(parse_packets(data))
        with self.counter.windows.lock:
            for payload, prefix in packets:
                self.counter.packet(payload, now, prefix)
        return len(packets)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

"""The conntrack flow source: connections the owned table marked, inbound and outbound, from the
kernel's connection-tracking events, into flow windows (agent/flowwindow.py).

It joins the NEW and DESTROY event groups first and then dumps the live table, deduplicating by
conntrack id and original tuple (the other order misses connections: measured, joining first missed
0 of 528 connections, dumping first 99 of 559; the id alone is a 32-bit hash that two live
connections share now and then). A connection counts once: when its NEW event arrives, when the dump
finds it live (first seen at the subscription), or, if both were lost (a buffer overrun), when its
DESTROY event arrives. Bytes arrive with DESTROY and count in
the window in which the connection ended. Only connections whose ct mark Palisade set count: the mark's
high byte is the decision with two flags, its low 24 bits the deciding rule's lifetime number
(policy/renderer.py). Flag OUTBOUND says this workload originated the connection: its peer is then the
original destination and its port the destination's (never the local ephemeral one); flag FAILSAFE says
the fail-safe list (DNS, NTP) admitted it, with no rule.

A full socket buffer makes `recv` fail with ENOBUFS: events were lost. After that the kernel drops
further events without saying so until the socket's queue is empty (netlink's congested state), so the
source first reads what is queued, then dumps the table again, so that connections still open are
recovered (counted once, by id). That is a `source_overrun` gap from the last event read before the
failure (or the last dump, if later) to the moment the queue was empty: every silent drop lies inside it.

The socket and its datagrams are agent/netlink.py's; this module parses and counts.
"""

from __future__ import annotations

import math
import socket
import struct
import time
from collections.abc import Callable
from typing import NamedTuple

from agent.flowwindow import INBOUND, OUTBOUND, FlowKey, Gap, Windows
from agent.netlink import (
    NLA_F_NESTED,
    NLA_HEADER,
    NLA_TYPE_MASK,
    Datagrams,
    drain_queued,
    is_overrun,
    latest,
    netlink_socket,
    spans,
)

NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_NEW, IPCTNL_MSG_CT_GET, IPCTNL_MSG_CT_DELETE = 0, 1, 2
NFNLGRP_CONNTRACK_NEW, NFNLGRP_CONNTRACK_DESTROY = 1, 3
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300

CTA_TUPLE_ORIG, CTA_MARK, CTA_COUNTERS_ORIG, CTA_COUNTERS_REPLY, CTA_ID, CTA_TIMESTAMP = 1, 8, 9, 10, 12, 20
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
CTA_COUNTERS_BYTES = 2
CTA_TIMESTAMP_STOP = 2

PROTOCOL_NAMES = {6: "tcp", 17: "udp", 1: "icmp", 58: "icmpv6"}
PORTED = (6, 17)

# The ct mark's layout, as policy/renderer.py writes it (the agent imports nothing of the control
# plane; tests/agent keeps the two equal).
DECISION_SHIFT = 24
RULE_NUMBER_MASK = (1 << DECISION_SHIFT) - 1
DECISION_NAMES = {1: "observed", 2: "allowed", 3: "would_block", 4: "blocked"}
# Flags beside the decision in the mark's high byte; an inbound mark has neither, as it always had.
FLAG_OUTBOUND = 0x80  # this workload originated the connection
FLAG_FAILSAFE = 0x40  # admitted by the fail-safe list (rule number 0): recorded allowed, with the marker
FLAGS = FLAG_OUTBOUND | FLAG_FAILSAFE
DECISION_MASK = 0xFF & ~FLAGS


def decode_mark(mark: int) -> tuple[str | None, int | None]:
    """(decision, rule number) of a ct mark, its flags aside; (None, None) for a mark Palisade did not set."""
    decision = DECISION_NAMES.get((mark >> DECISION_SHIFT) & DECISION_MASK) if 0 <= mark < 1 << 32 else None
    if decision is None:
        return None, None
    return decision, (mark & RULE_NUMBER_MASK) or None


def decode_mark_flags(mark: int) -> tuple[str | None, int | None, str, bool]:
    """(decision, rule number, direction, fail-safe) of a ct mark. The fail-safe flag counts only on an
    allowed mark, and such a connection has no rule whatever the low bits say (the contract gives 0)."""
    decision, rule = decode_mark(mark)
    flags = (mark >> DECISION_SHIFT) & FLAGS if decision is not None else 0
    direction = OUTBOUND if flags & FLAG_OUTBOUND else INBOUND
    failsafe = bool(flags & FLAG_FAILSAFE) and decision == "allowed"
    return decision, None if failsafe else rule, direction, failsafe


# A table sets a few marks (a decision and a rule number each), met on every event: each is decoded
# once, into the tail of its window key (decision, rule, direction, fail-safe), or None when Palisade
# did not set it. Bounded, as a hostile or foreign mark could be anything.
_MARK_TAILS: dict[int, tuple[str, int | None, str, bool] | None] = {}
_MARKS_KEPT = 1 << 16


def mark_tail(mark: int) -> tuple[str, int | None, str, bool] | None:
    tail = _MARK_TAILS.get(mark, _UNSEEN)
    if tail is _UNSEEN:
        decision, rule, direction, failsafe = decode_mark_flags(mark)
        tail = None if decision is None else (decision, rule, direction, failsafe)
        if len(_MARK_TAILS) >= _MARKS_KEPT:
            _MARK_TAILS.clear()
        _MARK_TAILS[mark] = tail
    return tail  # type: ignore[return-value]


_UNSEEN = object()


class Entry(NamedTuple):
    """One conntrack message: an event (NEW or DESTROY) or a dumped entry. A tuple, made in C for
    every event (see parse_entry); fields 1-6 are the connection's identity."""

    destroyed: bool
    id: int
    protocol: int
    source: str
    destination: str
    destination_port: int
    source_port: int
    mark: int
    bytes_in: int | None  # the original direction (from the originator); None when not accounted
    bytes_out: int | None
    stopped_ns: int | None  # with nf_conntrack_timestamp=1, when the connection ended


_NLMSG_LENGTH_AND_TYPE = struct.Struct("=IH")
_U16, _U32, _U64 = struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">Q")


def _address(raw: bytes) -> str:
    text = _ADDRESS_TEXT.get(raw)
    if text is None:
        if len(_ADDRESS_TEXT) >= _ADDRESSES_KEPT:
            _ADDRESS_TEXT.clear()
        text = _ADDRESS_TEXT[raw] = _address_text(raw)
    return text


# Most events name an address seen before (the workload's own, its usual peers): their text is kept.
_ADDRESS_TEXT: dict[bytes, str] = {}
_ADDRESSES_KEPT = 1 << 16


def _address_text(raw: bytes) -> str:
    # inet_ntop writes the same compressed text as ipaddress, at a tenth of the cost per event.
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw)
    text = socket.inet_ntop(socket.AF_INET6, raw)
    return text[7:] if text.startswith("::ffff:") and "." in text else text  # IPv4-mapped: the IPv4 address


def _bytes_counted(data: bytes, span: tuple[int, int]) -> int | None:
    counter = spans(data, *span).get(CTA_COUNTERS_BYTES)
    return _U64.unpack_from(data, counter[0])[0] if counter else None


# The original tuple of a TCP or UDP connection as the kernel lays it out (ctnetlink_dump_tuples): the
# nested IP and protocol attributes at fixed places. One unpack reads the headers and the values; a
# message whose headers differ (ICMP, or a layout this does not expect) takes the general walk.
def _header(length: int, kind: int) -> int:
    """An attribute header (host order) as the layout's big-endian unpack reads it."""
    return struct.unpack(">I", struct.pack("=HH", length, kind))[0]


def _tuple_layout(address_bytes: int, src: int, dst: int) -> tuple[struct.Struct, tuple[int, ...]]:
    ip_length = 4 + 2 * (4 + address_bytes)
    layout = struct.Struct(f">4xI I{address_bytes}s I{address_bytes}s I IB3x IH2x IH2x")
    headers = (
        _header(ip_length, CTA_TUPLE_IP | NLA_F_NESTED),
        _header(4 + address_bytes, src),
        _header(4 + address_bytes, dst),
        _header(28, CTA_TUPLE_PROTO | NLA_F_NESTED),
        _header(5, CTA_PROTO_NUM),
        _header(6, CTA_PROTO_SRC_PORT),
        _header(6, CTA_PROTO_DST_PORT),
    )
    return layout, headers


_PORTED_TUPLES = (
    _tuple_layout(4, CTA_IP_V4_SRC, CTA_IP_V4_DST),
    _tuple_layout(16, CTA_IP_V6_SRC, CTA_IP_V6_DST),
)


def _ported_tuple(data: bytes, offset: int, end: int) -> tuple[bytes, bytes, int, int, int] | None:
    """The original tuple at `offset` (its attribute header) if it has the kernel's TCP/UDP layout:
    source, destination, protocol, source port, destination port."""
    for layout, headers in _PORTED_TUPLES:
        if offset + layout.size > end:
            continue
        ip, sh, src, dh, dst, ph, nh, protocol, sph, sport, dph, dport = layout.unpack_from(data, offset)
        if (ip, sh, dh, ph, nh, sph, dph) == headers and protocol in PORTED:
            return src, dst, protocol, sport, dport
    return None


def _any_tuple(data: bytes, span: tuple[int, int]) -> tuple[bytes, bytes, int, int, int] | None:
    """The original tuple by walking its attributes: any protocol, any order."""
    parts = spans(data, *span)
    ip, proto_span = parts.get(CTA_TUPLE_IP), parts.get(CTA_TUPLE_PROTO)
    if ip is None or proto_span is None:
        return None
    addresses = spans(data, *ip)
    proto = spans(data, *proto_span)
    number = proto.get(CTA_PROTO_NUM)
    if number is None:
        return None
    if CTA_IP_V4_SRC in addresses:
        src, dst = addresses[CTA_IP_V4_SRC], addresses.get(CTA_IP_V4_DST)
    elif CTA_IP_V6_SRC in addresses:
        src, dst = addresses[CTA_IP_V6_SRC], addresses.get(CTA_IP_V6_DST)
    else:
        return None
    if dst is None:
        return None
    protocol = data[number[0]]
    sport = dport = 0
    sport_at, dport_at = proto.get(CTA_PROTO_SRC_PORT), proto.get(CTA_PROTO_DST_PORT)
    if protocol in PORTED and sport_at is not None and dport_at is not None:
        sport, dport = _U16.unpack_from(data, sport_at[0])[0], _U16.unpack_from(data, dport_at[0])[0]
    return bytes(data[src[0] : src[1]]), bytes(data[dst[0] : dst[1]]), protocol, sport, dport


def _top_level(data: bytes, offset: int, end: int) -> tuple[tuple[int, int] | None, ...]:
    """Where the top-level attributes this source reads are, as (tuple_orig, id, mark, counters_orig,
    counters_reply, timestamp) (payload start, end) or None.

    The kernel lays out every event of one kind alike (a UDP NEW over IPv4: the same attributes, the
    same lengths, in the same order), so a layout once walked is kept with the headers it met: when
    every one of those headers is found again at its place, in one unpack, the walk would take the same
    steps and find the same positions. Only then is it skipped; any other message is walked."""
    first = offset == _FIRST_BODY  # an event's message (one a datagram), or a dump's first
    known = _LAYOUTS.get(end) if first else None
    if known is not None and known[0].unpack_from(data, offset) == known[1]:
        return known[2]
    found: list[tuple[int, int] | None] = [None] * 6
    unpack, slots, type_mask = NLA_HEADER.unpack_from, _TOP_LEVEL_SLOTS.get, NLA_TYPE_MASK
    met = []  # where each header the walk read is
    at = offset
    while at + 4 <= end:
        length, kind = unpack(data, at)
        met.append(at)
        if length < 4:
            break
        slot = slots(kind & type_mask)
        if slot is not None:
            found[slot] = (at + 4, at + length)
        at += (length + 3) & ~3
    result = tuple(found)
    if first:
        if len(_LAYOUTS) >= _LAYOUTS_KEPT:
            _LAYOUTS.clear()
        _LAYOUTS[end] = _layout_of(data, offset, met, result)
    return result


def _layout_of(data: bytes, offset: int, met: list[int], found: tuple) -> tuple[struct.Struct, tuple, tuple]:
    """The unpack reading the headers at `met` (each as one 32-bit word), what it read, and `found`."""
    parts, position = ["="], offset
    for at in met:
        parts.append(f"{at - position}xI")
        position = at + 4
    layout = struct.Struct("".join(parts))
    return layout, layout.unpack_from(data, offset), found


# Layouts of a datagram's first message, by its end: events come one a datagram, and a few dozen
# layouts (protocol, family, NEW or DESTROY, accounting) serve a busy host.
_FIRST_BODY = 16 + 4  # after the netlink header and netfilter's
_LAYOUTS: dict[int, tuple[struct.Struct, tuple, tuple]] = {}
_LAYOUTS_KEPT = 256


_TOP_LEVEL_SLOTS = {CTA_TUPLE_ORIG: 0, CTA_ID: 1, CTA_MARK: 2, CTA_COUNTERS_ORIG: 3, CTA_COUNTERS_REPLY: 4,
                    CTA_TIMESTAMP: 5}  # fmt: skip


def parse_entry(
    message_type: int, data: bytes, offset: int = 0, end: int | None = None, *, marked_only: bool = False
) -> Entry | None:
    """A conntrack message body (after the netlink header) at data[offset:end]: None for what is not a
    connection, or, with `marked_only`, for a connection Palisade's table did not mark (read no further:
    on a busy host most are)."""
    return _parse_entry(message_type, data, offset, len(data) if end is None else end, marked_only)


def _parse_entry(message_type: int, data: bytes, offset: int, end: int, marked_only: bool) -> Entry | None:
    tuple_orig, ident, mark, counters_orig, counters_reply, timestamp = _top_level(data, offset + 4, end)
    if tuple_orig is None or ident is None:
        return None
    mark_value = _U32.unpack_from(data, mark[0])[0] if mark is not None else 0
    if marked_only and mark_tail(mark_value) is None:
        return None
    # The kernel's TCP/UDP layout is read in one unpack (from the attribute's header); any other walks.
    found = _ported_tuple(data, tuple_orig[0] - 4, tuple_orig[1]) or _any_tuple(data, tuple_orig)
    if found is None:
        return None
    src, dst, protocol, sport, dport = found
    bytes_in = bytes_out = stopped = None
    if counters_orig is not None and counters_reply is not None:
        bytes_in, bytes_out = _bytes_counted(data, counters_orig), _bytes_counted(data, counters_reply)
    if timestamp is not None:
        stop = spans(data, *timestamp).get(CTA_TIMESTAMP_STOP)
        stopped = _U64.unpack_from(data, stop[0])[0] if stop else None
    return _new_entry(
        Entry,
        (
            (message_type & 0xFF) == IPCTNL_MSG_CT_DELETE,
            _U32.unpack_from(data, ident[0])[0],
            protocol,
            _address(src),
            _address(dst),
            dport,
            sport,
            mark_value,
            bytes_in,
            bytes_out,
            stopped,
        ),
    )


_new_entry = tuple.__new__


def parse_messages(data: bytes, *, marked_only: bool = False) -> list[Entry]:
    entries: list[Entry] = []
    _parse_into(entries, data, marked_only)
    return entries


def _parse_into(entries: list[Entry], data: bytes, marked_only: bool) -> None:
    offset, size = 0, len(data)
    unpack = _NLMSG_LENGTH_AND_TYPE.unpack_from
    while offset + 16 <= size:
        length, message_type = unpack(data, offset)
        if length < 16:
            break
        if message_type >> 8 == NFNL_SUBSYS_CTNETLINK:
            end = offset + length
            entry = _parse_entry(message_type, data, offset + 16, end if end < size else size, marked_only)
            if entry is not None:
                entries.append(entry)
        offset += (length + 3) & ~3


def key_of(entry: Entry) -> FlowKey | None:
    """The window key of a connection Palisade's table marked; None for every other connection. The
    peer is the remote end of the original tuple: its source inbound, its destination outbound; the
    port is the destination's either way (the service connected to)."""
    tail = mark_tail(entry.mark)
    if tail is None:
        return None
    protocol = PROTOCOL_NAMES.get(entry.protocol) or str(entry.protocol)
    peer = entry.destination if tail[2] == OUTBOUND else entry.source
    # tuple.__new__ skips the NamedTuple's own __new__, a Python function, on every event.
    return _new_key(FlowKey, (peer, protocol, entry.destination_port) + tail)


_new_key = tuple.__new__


def _identity(entry: Entry) -> tuple:
    """The conntrack id with the original tuple (id, protocol, source, destination, both ports)."""
    return entry[1:7]


class ConntrackCounter:
    """What the source does with entries, apart from sockets: count each marked connection once."""

    def __init__(self, windows: Windows):
        self.windows = windows
        # Live connections already counted. The conntrack id is a 32-bit hash, not unique: among 80,000
        # live entries two share one about as often as not, so the id goes with the original tuple.
        self.counted: dict[tuple, FlowKey] = {}
        # Counted connections the last complete dump no longer held: forgotten, but recognised for one
        # dump more, should a DESTROY sent while that dump ran arrive after it.
        self.ended: dict[tuple, FlowKey] = {}
        self.last_event_at: float | None = None
        self.overruns = 0
        self.events_read = 0  # events of marked connections (the others are dropped unparsed)

    def _count(self, entry: Entry, at: float) -> FlowKey | None:
        identity = _identity(entry)
        known = self.counted.get(identity)
        if known is not None:
            return known
        key = key_of(entry)
        if key is not None:
            self.windows.connection_opened(key, at)
            self.counted[identity] = key
        return key

    def subscribed(self, entries: list[Entry], at: float, *, complete: bool = True) -> None:
        """The table as dumped just after joining the event groups: live connections count once,
        first seen now. A complete dump is also when the source forgets the connections whose end it
        never heard of (a DESTROY lost in an overrun, or never sent: events were off), which would
        otherwise be kept for the life of the process."""
        with self.windows.lock:
            live = {}
            for entry in entries:
                key = self._count(entry, at)
                if key is not None:
                    live[_identity(entry)] = key
        if complete:
            self.ended = {identity: key for identity, key in self.counted.items() if identity not in live}
            self.counted = live

    def events(self, entries: list[Entry], at: float) -> None:
        """A batch of events read at `at` (possibly none marked: unmarked ones are dropped unparsed).
        NEW events, nearly all of a burst, are counted here with the window found once per batch."""
        self.last_event_at = at
        self.events_read += len(entries)
        counted = self.counted
        opened: list[FlowKey] = []
        with self.windows.lock:
            for entry in entries:
                if entry.destroyed:
                    if opened:  # counted first: the DESTROY may be of a connection opened in this batch
                        self.windows.connections_opened(opened, at)
                        opened = []
                    self.event(entry, at)
                    continue
                identity = entry[1:7]  # _identity, inline on the per-event path
                if identity in counted:
                    continue
                key = key_of(entry)
                if key is not None:
                    counted[identity] = key
                    opened.append(key)
            if opened:
                self.windows.connections_opened(opened, at)

    def event(self, entry: Entry, at: float) -> None:
        if not entry.destroyed:
            self._count(entry, at)
            return
        identity = _identity(entry)
        # Opened and closed unseen (its NEW was lost): counted now; unless it was counted and forgotten.
        key = self.ended.pop(identity, None) or self._count(entry, at)
        self.counted.pop(identity, None)
        if key is None:
            return
        ended = entry.stopped_ns / 1e9 if entry.stopped_ns else at
        if entry.bytes_in is not None and entry.bytes_out is not None:
            # bytes_in is what this workload received: the reply direction of a connection it originated.
            if key.direction == OUTBOUND:
                self.windows.bytes_counted(key, ended, entry.bytes_out, entry.bytes_in)
            else:
                self.windows.bytes_counted(key, ended, entry.bytes_in, entry.bytes_out)
        else:
            self.windows.bytes_not_counted(ended)

    def overrun(self, *, since: float | None, at: float) -> Gap:
        """Events were lost between `since` (the last one read before the failure) and `at`."""
        self.overruns += 1
        return Gap(
            "source_overrun", "conntrack", since if since is not None and since < at else at - 0.001, at, {}
        )


class ConntrackSource:
    """Subscribe (join, then dump), then read events until stopped; losses become gaps in `gaps`.

    `read_once` reads what is waiting (blocking up to `timeout`); an overrun is recorded and the table
    dumped again, so the connections still open are recovered. The daemon calls it from one thread.
    """

    def __init__(
        self, windows: Windows, *, buffer_bytes: int, dump_max: int, clock: Callable[[], float] = time.time
    ):
        self.clock = clock
        self.counter = ConntrackCounter(windows)
        self.buffer_bytes, self.dump_max = buffer_bytes, dump_max
        self.gaps: list[Gap] = []
        self.sock: socket.socket | None = None
        self.subscribed_at: float | None = None
        self.accounting_read_at = -math.inf

    def subscribe(self) -> None:
        if not events_enabled():
            raise EventsOff(since=None)
        self.sock = event_socket(self.buffer_bytes)
        self.datagrams = Datagrams(self.sock)
        self._dump()

    def _dump(self) -> None:
        at = self.clock()
        entries, over = dump(limit=self.dump_max)
        if over:
            # Connections beyond the bound were live and are not counted: evidence lost at this instant.
            self.gaps.append(Gap("dump_truncated", "conntrack", at - 0.001, at, {"entries": over}))
        self.counter.subscribed(entries, at, complete=not over)
        self.subscribed_at = at

    def read_once(self, timeout: float) -> int:
        if self.sock is None:
            raise RuntimeError("subscribe before reading events")
        self._accounting_follow()
        try:
            entries = read_events(self.datagrams, timeout)
        except OSError as error:
            if not is_overrun(error):
                raise
            since = latest(self.counter.last_event_at, self.subscribed_at)  # the dump saw what came before
            drain_queued(self.datagrams, self._events)
            self.gaps.append(self.counter.overrun(since=since, at=self.clock()))
            self._dump()
            return 0
        if entries is None:
            # Quiet. So it is when the kernel stopped sending events: then this source is down.
            if not events_enabled():
                raise EventsOff(since=latest(self.counter.last_event_at, self.subscribed_at))
            return 0
        self._count(entries)
        return len(entries)

    def _accounting_follow(self) -> None:
        """Windows opened from now on say whether accounting is on now: an operator may switch
        nf_conntrack_acct while the agent runs (read at most once a second)."""
        now = self.clock()
        if now - self.accounting_read_at >= 1.0:
            self.accounting_read_at = now
            self.counter.windows.accounting = accounting_enabled()

    def _events(self, data: bytes) -> None:
        self._count(parse_messages(data, marked_only=True))

    def _count(self, entries: list[Entry]) -> None:
        self.counter.events(entries, self.clock())

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def event_socket(buffer_bytes: int) -> socket.socket:
    """Joined to the NEW and DESTROY groups (`--flow-netlink-buffer` bytes of buffer)."""
    groups = (1 << (NFNLGRP_CONNTRACK_NEW - 1)) | (1 << (NFNLGRP_CONNTRACK_DESTROY - 1))
    return netlink_socket(groups, buffer_bytes)


def dump(buffer_bytes: int = 8 << 20, *, limit: int | None = None) -> tuple[list[Entry], int]:
    """The live table, both families, at most `limit` entries; and how many more it held."""
    with netlink_socket(0, buffer_bytes) as sock:
        request = struct.pack(
            "=IHHII", 20, (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET, NLM_F_REQUEST | NLM_F_DUMP, 1, 0
        )
        sock.send(request + struct.pack("=BBH", socket.AF_UNSPEC, 0, 0))
        entries: list[Entry] = []
        over = 0
        while True:
            data = sock.recv(1 << 20)
            done = False
            offset = 0
            while offset + 16 <= len(data):
                length, message_type = struct.unpack_from("=IH", data, offset)
                if message_type in (NLMSG_DONE, NLMSG_ERROR):
                    done = True
                    break
                offset += (length + 3) & ~3
            for entry in parse_messages(data):
                if limit is not None and len(entries) >= limit:
                    over += 1
                    continue
                entries.append(entry)
            if done:
                return entries, over


def read_events(datagrams: Datagrams, timeout: float) -> list[Entry] | None:
    """The events of the datagrams queued, waiting up to `timeout` for one (None if none came);
    OSError(ENOBUFS) when some were lost."""
    batch = datagrams.next(timeout)
    if not batch:
        return None
    entries: list[Entry] = []
    for data in batch:
        _parse_into(entries, data, True)
    return entries


class EventsOff(OSError):
    """The kernel sends no connection events in this namespace (net.netfilter.nf_conntrack_events=0):
    connections open unseen, and those opened meanwhile never send one, not even when it ends. The
    source is down (a `source_restart` gap from `since`, the last event read) until events are on again
    and it subscribes anew, its dump recovering what is still open."""

    def __init__(self, *, since: float | None):
        super().__init__("connection events are off in this namespace (net.netfilter.nf_conntrack_events=0)")
        self.since = since


def events_enabled() -> bool:
    """nf_conntrack_events: 1 sends events, 2 (the default since Linux 6.0) sends them to listeners, as
    this source is; 0 sends none. Read on every quiet spell: one small file, twice a second at most."""
    try:
        with open("/proc/sys/net/netfilter/nf_conntrack_events") as file:
            return file.read().strip() != "0"
    except OSError:
        return True  # conntrack not loaded yet: nothing is tracked, so nothing is missed


def accounting_enabled() -> bool:
    try:
        with open("/proc/sys/net/netfilter/nf_conntrack_acct") as file:
            return file.read().strip() == "1"
    except OSError:
        return False

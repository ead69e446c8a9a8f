"""Outbound evidence on the agent, no namespace needed: the mark's flags (0x80 outbound, 0x40 fail-safe)
decoded into the key, the peer and port of an outgoing connection, the bytes each way, the NFLOG prefix
of an outbound drop, and the key as the report carries it."""

from __future__ import annotations

import socket
import struct

import pytest

from agent import conntrack, nflog
from agent.flowbuffer import window_from_record, window_record
from agent.flowwindow import AGGREGATE, FlowKey, Windows
from tests.agent.test_conntrack_messages import message, nla

OUT, SAFE = conntrack.FLAG_OUTBOUND, conntrack.FLAG_FAILSAFE


def mark(flags: int, decision: int, rule: int = 0) -> int:
    return (flags | decision) << conntrack.DECISION_SHIFT | rule


@pytest.mark.parametrize(
    "value, decoded",
    [
        (mark(0, 2, 7), ("allowed", 7, "inbound", False)),  # an inbound mark reads as it always did
        (mark(0, 1), ("observed", None, "inbound", False)),
        (mark(OUT, 2, 7), ("allowed", 7, "outbound", False)),
        (mark(OUT, 3), ("would_block", None, "outbound", False)),
        (mark(OUT, 4), ("blocked", None, "outbound", False)),
        (mark(OUT | SAFE, 2), ("allowed", None, "outbound", True)),
        (mark(OUT | SAFE, 2, 9), ("allowed", None, "outbound", True)),  # fail-safe: never a rule
        (mark(OUT | SAFE, 3), ("would_block", None, "outbound", False)),  # the marker is allowed's only
        (mark(OUT, 0), (None, None, "inbound", False)),  # flags without a decision: not Palisade's
        (mark(OUT, 9), (None, None, "inbound", False)),
        (mark(0x20, 2, 7), (None, None, "inbound", False)),  # a bit the contract does not define
    ],
)
def test_the_mark_flags_are_decoded_beside_the_decision(value, decoded):
    assert conntrack.decode_mark_flags(value) == decoded
    assert conntrack.decode_mark(value)[0] == decoded[0]  # the decision alone reads past the flags


def test_an_outbound_key_names_the_destination_and_its_port_never_the_ephemeral_one():
    # The workload 10.0.0.1 connects from its ephemeral port 51234 to 192.0.2.9:5432.
    (entry,) = conntrack.parse_messages(
        message(src="10.0.0.1", dst="192.0.2.9", sport=51234, dport=5432, mark=mark(OUT, 2, 12))
    )
    assert conntrack.key_of(entry) == FlowKey("192.0.2.9", "tcp", 5432, "allowed", 12, "outbound", False)
    (dns,) = conntrack.parse_messages(
        message(src="fd00::1", dst="fd00::53", protocol=17, sport=40001, dport=53,
                mark=mark(OUT | SAFE, 2), family=socket.AF_INET6)
    )  # fmt: skip
    assert conntrack.key_of(dns) == FlowKey("fd00::53", "udp", 53, "allowed", None, "outbound", True)
    (inbound,) = conntrack.parse_messages(message(src="10.0.0.2", dst="10.0.0.1", sport=40000, dport=443))
    assert conntrack.key_of(inbound) == FlowKey("10.0.0.2", "tcp", 443, "allowed", 7)
    assert conntrack.key_of(inbound).direction == "inbound"
    assert conntrack.parse_messages(message(mark=mark(OUT, 3)), marked_only=True) != []


def test_bytes_in_are_what_the_workload_received_both_ways():
    windows = Windows(length=60, max_keys=100, accounting=True)
    counter = conntrack.ConntrackCounter(windows)
    # The original direction is the originator's: the workload's own request outbound (300 bytes sent,
    # 9000 received), the peer's inbound.
    out = message(destroyed=True, src="10.0.0.1", dst="192.0.2.9", sport=51234, dport=80,
                  mark=mark(OUT, 2, 3), counters=(300, 9000), ident=1)  # fmt: skip
    into = message(destroyed=True, src="192.0.2.9", dst="10.0.0.1", sport=40000, dport=443,
                   mark=mark(0, 2, 4), counters=(300, 9000), ident=2)  # fmt: skip
    counter.events(conntrack.parse_messages(out + into), at=10.0)
    (closed,), _ = windows.close_due(60.0, "v1")
    counted = {key.direction: (c.connection_count, c.bytes_in, c.bytes_out) for key, c in closed.groups}
    assert counted == {"outbound": (1, 9000, 300), "inbound": (1, 300, 9000)}


def test_the_same_peer_and_port_each_way_are_two_keys_and_aggregate_apart():
    windows = Windows(length=60, max_keys=1, accounting=False)  # one key of each direction
    both = [
        FlowKey("192.0.2.9", "tcp", 443, "allowed", 7, direction) for direction in ("inbound", "outbound")
    ]
    for key in both:
        windows.connection_opened(key, 1.0)
    windows.connection_opened(FlowKey("192.0.2.10", "tcp", 443, "allowed", 7, "outbound"), 2.0)
    windows.connection_opened(FlowKey("192.0.2.11", "tcp", 443, "allowed", 7), 3.0)
    (closed,), (gap,) = windows.close_due(60.0, "v1")
    counted = {key: c.connection_count for key, c in closed.groups}
    assert counted == {
        both[0]: 1,
        both[1]: 1,
        FlowKey(AGGREGATE, AGGREGATE, 0, "allowed", None, "outbound"): 1,
        FlowKey(AGGREGATE, AGGREGATE, 0, "allowed", None, "inbound"): 1,
    }
    assert gap.lost == {"keys": 2, "connections": 2}


def test_a_key_on_the_wire_says_direction_and_failsafe_only_when_not_inbound_and_not_false():
    windows = Windows(length=60, max_keys=10, accounting=False)
    keys = [
        FlowKey("10.0.0.2", "tcp", 443, "allowed", 7),
        FlowKey("192.0.2.9", "tcp", 5432, "blocked", None, "outbound"),
        FlowKey("192.0.2.53", "udp", 53, "allowed", None, "outbound", True),
    ]
    for key in keys:
        windows.connection_opened(key, 1.0)
    (closed,), _ = windows.close_due(60.0, "v1")
    record = window_record(closed)
    on_wire = {(g["peer"], g.get("direction"), g.get("failsafe")) for g in record["groups"]}
    assert on_wire == {
        ("10.0.0.2", None, None),
        ("192.0.2.9", "outbound", None),
        ("192.0.2.53", "outbound", True),
    }
    inbound = next(g for g in record["groups"] if g["peer"] == "10.0.0.2")
    assert list(inbound)[:5] == ["peer", "protocol", "port", "decision", "rule"]  # the bytes it always had
    assert window_from_record(record) == closed  # and the buffer reads it back, old records too


def nflog_message(payload: bytes, prefix: bytes | None) -> bytes:
    attributes = nla(nflog.NFULA_PAYLOAD, payload)
    if prefix is not None:
        attributes += nla(nflog.NFULA_PREFIX, prefix + b"\0")
    body = struct.pack("=BBH", socket.AF_INET, 0, 0) + attributes
    kind = (nflog.NFNL_SUBSYS_ULOG << 8) | nflog.NFULNL_MSG_PACKET
    return struct.pack("=IHHII", 16 + len(body), kind, 0, 0, 0) + body


def syn(source: str, destination: str, sport: int, dport: int) -> bytes:
    ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 40, 0, 0, 64, 6, 0,
                     socket.inet_aton(source), socket.inet_aton(destination))  # fmt: skip
    return ip + struct.pack(">HHIIBBHHH", sport, dport, 0, 0, 0x50, 0x02, 0, 0, 0)


@pytest.mark.parametrize(
    "prefix, parsed",
    [
        (b"", ("inbound", None)),
        (b"palisade:in", ("inbound", None)),
        (b"palisade:out", ("outbound", None)),
        (b"palisade:out:42", ("outbound", 42)),
        (b"palisade:in:42", ("inbound", 42)),
        (b"palisade:out:0", ("outbound", None)),
        (b"palisade:out:16777216", ("outbound", None)),  # past 24 bits: not a rule number
        (b"palisade:out:x", ("outbound", None)),
        (b"palisade:sideways", ("inbound", None)),
        (b"someone else's", ("inbound", None)),
    ],
)
def test_the_nflog_prefix_says_the_direction_of_a_drop(prefix, parsed):
    assert nflog.parse_prefix(prefix) == parsed


def test_an_outbound_drop_counts_its_destination_and_port_inbound_its_source():
    windows = Windows(length=60, max_keys=10, accounting=False)
    counter = nflog.BlockedCounter(windows)
    datagram = (
        nflog_message(syn("10.0.0.1", "192.0.2.9", 51234, 9090), b"palisade:out")
        + nflog_message(syn("10.0.0.1", "192.0.2.9", 51234, 9090), b"palisade:out")  # a retransmit
        + nflog_message(syn("10.0.0.1", "192.0.2.9", 51235, 9090), b"palisade:out")  # a second attempt
        + nflog_message(syn("192.0.2.7", "10.0.0.1", 40000, 22), None)  # what inbound rules log
    )
    for payload, prefix in nflog.parse_packets(datagram):
        counter.packet(payload, 5.0, prefix)
    (closed,), _ = windows.close_due(60.0, "v1")
    assert {key: c.connection_count for key, c in closed.groups} == {
        FlowKey("192.0.2.9", "tcp", 9090, "blocked", None, "outbound"): 2,
        FlowKey("192.0.2.7", "tcp", 22, "blocked", None): 1,
    }


def test_the_agent_reads_the_marks_the_renderer_sets():
    """The agent imports nothing of the control plane: the flags, the shift and every mark the output
    chain can set must still mean the same on both sides."""
    from policy import renderer

    assert (conntrack.FLAG_OUTBOUND, conntrack.FLAG_FAILSAFE) == (
        renderer.DIRECTION_OUTBOUND_FLAG,
        renderer.FAILSAFE_FLAG,
    )
    assert conntrack.DECISION_SHIFT == renderer.DECISION_SHIFT
    for decision, name in renderer.DECISION_NAMES.items():
        for flags in (0, renderer.DIRECTION_OUTBOUND_FLAG):
            value = renderer.encode_mark(decision, 7, flags)
            got = conntrack.decode_mark_flags(value)
            want = renderer.decode_any_mark(value)
            assert want is not None
            assert got == (name, want.rule, want.direction, want.failsafe)
    safe = renderer.encode_mark(
        renderer.DECISION_ALLOWED, 0, renderer.DIRECTION_OUTBOUND_FLAG | renderer.FAILSAFE_FLAG
    )
    assert conntrack.decode_mark_flags(safe) == ("allowed", None, "outbound", True)

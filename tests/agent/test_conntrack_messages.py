"""The conntrack message parser against messages built to the kernel's layout (no namespace needed):
both families, TCP, UDP and ICMP, NEW and DESTROY, with and without counters and timestamps."""

from __future__ import annotations

import socket
import struct

import pytest

from agent import conntrack


def nla(kind: int, payload: bytes, nested: bool = False) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind | (0x8000 if nested else 0)) + payload + b"\0" * (-length % 4)


def address(text: str) -> bytes:
    return socket.inet_pton(socket.AF_INET6 if ":" in text else socket.AF_INET, text)


def tuple_attr(kind: int, src: str, dst: str, protocol: int, sport: int, dport: int) -> bytes:
    v6 = ":" in src
    ip = nla(1, nla(3 if v6 else 1, address(src)) + nla(4 if v6 else 2, address(dst)), True)
    ports = (
        nla(2, struct.pack(">H", sport)) + nla(3, struct.pack(">H", dport)) if protocol in (6, 17) else b""
    )
    icmp = (
        nla(4, struct.pack(">H", 77)) + nla(5, bytes([8])) + nla(6, bytes([0]))
        if protocol in (1, 58)
        else b""
    )
    return nla(kind, ip + nla(2, nla(1, bytes([protocol])) + ports + icmp, True), True)


def message(*, destroyed=False, src="10.0.0.2", dst="10.0.0.1", protocol=6, sport=40000, dport=443,
            mark=(2 << 24) | 7, ident=1234, counters=None, stopped_ns=None, family=socket.AF_INET) -> bytes:  # fmt: skip
    body = struct.pack("=BBH", family, 0, 0)
    body += tuple_attr(1, src, dst, protocol, sport, dport) + tuple_attr(2, dst, src, protocol, dport, sport)
    body += nla(3, struct.pack(">I", 8)) + nla(7, struct.pack(">I", 30))
    if mark is not None:
        body += nla(8, struct.pack(">I", mark))
    if counters is not None:
        body += nla(9, nla(1, struct.pack(">Q", 3)) + nla(2, struct.pack(">Q", counters[0])), True)
        body += nla(10, nla(1, struct.pack(">Q", 2)) + nla(2, struct.pack(">Q", counters[1])), True)
    body += nla(12, struct.pack(">I", ident)) + nla(11, struct.pack(">I", 1))
    if stopped_ns is not None:
        body += nla(
            20, nla(1, struct.pack(">Q", stopped_ns - 10**9)) + nla(2, struct.pack(">Q", stopped_ns)), True
        )
    kind = (1 << 8) | (2 if destroyed else 0)
    return struct.pack("=IHHII", 16 + len(body), kind, 0, 0, 0) + body


@pytest.mark.parametrize(
    "built, expected",
    [
        (message(), dict(destroyed=False, protocol=6, source="10.0.0.2", destination="10.0.0.1",
                         source_port=40000, destination_port=443, mark=(2 << 24) | 7, bytes_in=None)),
        (message(src="fd00::2", dst="fd00::1", protocol=17, sport=5353, dport=53, family=socket.AF_INET6),
         dict(protocol=17, source="fd00::2", destination="fd00::1", source_port=5353, destination_port=53)),
        (message(src="::ffff:10.0.0.9", dst="::ffff:10.0.0.1", family=socket.AF_INET6),
         dict(source="10.0.0.9", destination="10.0.0.1")),
        (message(protocol=1), dict(protocol=1, source_port=0, destination_port=0)),
        (message(src="fd00::2", dst="fd00::1", protocol=58, family=socket.AF_INET6),
         dict(protocol=58, source="fd00::2", source_port=0, destination_port=0)),
        (message(mark=None), dict(mark=0)),
        (message(destroyed=True, counters=(1200, 48000), stopped_ns=1_800_000_000 * 10**9),
         dict(destroyed=True, bytes_in=1200, bytes_out=48000, stopped_ns=1_800_000_000 * 10**9, id=1234)),
    ],
)  # fmt: skip
def test_each_field_is_read_where_the_kernel_puts_it(built, expected):
    (entry,) = conntrack.parse_messages(built)
    assert {name: getattr(entry, name) for name in expected} == expected


def test_several_messages_in_one_datagram_and_what_is_not_a_connection():
    datagram = message(ident=1) + message(ident=2, protocol=17)
    assert [e.id for e in conntrack.parse_messages(datagram)] == [1, 2]
    no_tuple = struct.pack("=IHHII", 20, 1 << 8, 0, 0, 0) + struct.pack("=BBH", 2, 0, 0)
    assert list(conntrack.parse_messages(no_tuple)) == []
    assert list(conntrack.parse_messages(message()[:30])) == []  # cut short: nothing made up


def test_the_window_key_comes_from_the_mark():
    (allowed,) = conntrack.parse_messages(message(mark=(2 << 24) | 7))
    (unmarked,) = conntrack.parse_messages(message(mark=None))
    assert conntrack.key_of(allowed) == conntrack.FlowKey("10.0.0.2", "tcp", 443, "allowed", 7)
    assert conntrack.key_of(unmarked) is None
    for mark in (None, 0, 9 << 24):  # none, zero, not a decision: not read past the mark
        assert conntrack.parse_messages(message(mark=mark), marked_only=True) == []
    assert len(conntrack.parse_messages(message(), marked_only=True)) == 1


@pytest.mark.parametrize("family, src, dst", [(socket.AF_INET, "10.0.0.2", "10.0.0.1"),
                                              (socket.AF_INET6, "fd00::2", "fd00::1")])  # fmt: skip
@pytest.mark.parametrize("protocol", [6, 17])
def test_the_one_unpack_path_reads_what_the_walk_reads(family, src, dst, protocol):
    built = message(src=src, dst=dst, protocol=protocol, sport=61000, dport=8443, family=family)
    orig_at = 16 + 4  # the netlink and nfgenmsg headers
    length = struct.unpack_from("=H", built, orig_at)[0]
    fast = conntrack._ported_tuple(built, orig_at, orig_at + length)
    assert fast is not None
    assert fast == conntrack._any_tuple(built, (orig_at + 4, orig_at + length))
    assert fast[2:] == (protocol, 61000, 8443)


def test_a_tuple_laid_out_otherwise_is_walked_not_misread():
    """The same tuple with its ports in the other order: the one-unpack path declines, the walk reads it."""
    ip = nla(1, nla(1, address("10.0.0.2")) + nla(2, address("10.0.0.1")), True)
    proto = nla(
        2, nla(1, bytes([6])) + nla(3, struct.pack(">H", 443)) + nla(2, struct.pack(">H", 40000)), True
    )
    body = struct.pack("=BBH", socket.AF_INET, 0, 0) + nla(1, ip + proto, True)
    body += nla(8, struct.pack(">I", (2 << 24) | 7)) + nla(12, struct.pack(">I", 9))
    built = struct.pack("=IHHII", 16 + len(body), 1 << 8, 0, 0, 0) + body
    assert conntrack._ported_tuple(built, 20, 20 + 4 + len(ip) + len(proto)) is None
    (entry,) = conntrack.parse_messages(built)
    assert (entry.source, entry.source_port, entry.destination_port, entry.id) == ("10.0.0.2", 40000, 443, 9)


def _reordered(first: bytes, second: bytes) -> bytes:
    """A message of the builder's length whose mark and id attributes trade places (8 bytes each)."""
    body = struct.pack("=BBH", socket.AF_INET, 0, 0)
    body += tuple_attr(1, "10.0.0.2", "10.0.0.1", 17, 40000, 53) + tuple_attr(
        2, "10.0.0.1", "10.0.0.2", 17, 53, 40000
    )
    body += (
        nla(3, struct.pack(">I", 8))
        + nla(7, struct.pack(">I", 30))
        + first
        + second
        + nla(11, struct.pack(">I", 1))
    )
    return struct.pack("=IHHII", 16 + len(body), 1 << 8, 0, 0, 0) + body  # fmt: skip


def test_a_layout_met_before_is_reused_only_where_every_header_is_found_again():
    """Events of one kind share a layout, which the parser keeps; a message of the same length laid out
    otherwise (mark and id swapped) must be walked, not read at the kept places."""
    mark, ident = nla(8, struct.pack(">I", (2 << 24) | 7)), nla(12, struct.pack(">I", 41))
    usual, swapped = _reordered(mark, ident), _reordered(ident, mark)
    assert len(usual) == len(swapped)
    for built in (usual, usual, swapped, swapped, usual):  # learnt, reused, then the other in turn
        (entry,) = conntrack.parse_messages(built, marked_only=True)
        assert (entry.mark, entry.id, entry.destination_port) == ((2 << 24) | 7, 41, 53)
    other = message(protocol=17, dport=5353, mark=(1 << 24) | 3, ident=77)  # the builder's own layout
    for _ in range(2):
        (entry,) = conntrack.parse_messages(other)
        assert (entry.mark, entry.id, entry.destination_port) == ((1 << 24) | 3, 77, 5353)

"""Reading a netlink socket's datagrams (agent/netlink.py), on a local datagram socket pair: the batching
and its limits do not depend on the socket's family."""

from __future__ import annotations

import errno
import socket

import pytest

from agent import netlink


def test_datagrams_are_read_in_batches_and_an_oversized_one_is_an_error():
    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with reader, writer:
        datagrams = netlink.Datagrams(reader, slots=4, slot_bytes=64)
        assert datagrams.queued() == []
        sent = [bytes([n]) * (n + 1) for n in range(6)]
        for data in sent:
            writer.send(data)
        assert datagrams.queued() == sent[:4]  # one batch of four slots, in order
        assert datagrams.next(1.0) == sent[4:]
        assert datagrams.next(0.01) == []
        writer.send(b"x" * 65)
        with pytest.raises(OSError) as raised:
            datagrams.queued()
        assert raised.value.errno == errno.EMSGSIZE

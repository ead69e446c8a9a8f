"""Reading netfilter's netlink sockets, shared by the flow sources (agent/conntrack.py, agent/nflog.py):
the socket, its datagrams in batches, attribute walking, and what an overrun looks like.

Stdlib only (ctypes for `recvmmsg`, which Python's socket module lacks): a small reader parsed 35,000
conntrack events/s where pyroute2 did 14,000, and batching took a busy source's CPU down by a third.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import struct
import time
from collections.abc import Callable

NETLINK_NETFILTER = 12
SO_RCVBUFFORCE = 33
NLA_TYPE_MASK, NLA_F_NESTED = 0x3FFF, 0x8000
NLA_HEADER = struct.Struct("=HH")


def attributes_of(data: bytes, offset: int = 0, end: int | None = None) -> dict[int, bytes]:
    """The attributes between `offset` and `end` as type -> payload bytes."""
    found = spans(data, offset, len(data) if end is None else end)
    return {kind: data[start:stop] for kind, (start, stop) in found.items()}


def spans(data: bytes, offset: int, end: int) -> dict[int, tuple[int, int]]:
    """The attributes between `offset` and `end` as type -> (payload start, payload end): positions in
    one buffer, so that parsing copies no bytes until a value is read."""
    found = {}
    unpack = NLA_HEADER.unpack_from
    while offset + 4 <= end:
        length, kind = unpack(data, offset)
        if length < 4:
            break
        found[kind & NLA_TYPE_MASK] = (offset + 4, offset + length)
        offset += (length + 3) & ~3
    return found


def netlink_socket(groups: int, buffer_bytes: int) -> socket.socket:
    """A netfilter netlink socket with `buffer_bytes` of receive buffer, joined to `groups`."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, buffer_bytes)
        except PermissionError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        sock.bind((0, groups))
    except BaseException:
        sock.close()
        raise
    return sock


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_void_p),
        ("namelen", ctypes.c_uint32),
        ("iov", ctypes.POINTER(_Iovec)),
        ("iovlen", ctypes.c_size_t),
        ("control", ctypes.c_void_p),
        ("controllen", ctypes.c_size_t),
        ("flags", ctypes.c_int),
    ]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("header", _Msghdr), ("length", ctypes.c_uint)]


# Called without waiting (MSG_DONTWAIT), so it keeps the GIL: through PyDLL, not CDLL, whose release and
# re-acquisition of the GIL around each call cost more than the call itself.
_recvmmsg = ctypes.PyDLL(None, use_errno=True).recvmmsg
_recvmmsg.argtypes = [ctypes.c_int, ctypes.POINTER(_Mmsghdr), ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
_recvmmsg.restype = ctypes.c_int
MSG_TRUNC, MSG_DONTWAIT = 0x20, 0x40
# One mmsghdr as (msg_flags, msg_len), the rest skipped: the two fields recvmmsg writes back.
_FLAGS_AT = _Msghdr.flags.offset
_LENGTH_AT = _Mmsghdr.length.offset
_RESULT = struct.Struct(
    f"={_FLAGS_AT}xi{_LENGTH_AT - _FLAGS_AT - 4}xI{ctypes.sizeof(_Mmsghdr) - _LENGTH_AT - 4}x"
)
# Woken by a datagram, a reader lets more gather before it reads: at 20,000 events/s that turns one
# wake-up per event into one per batch. A window is a minute; 2 ms late costs nothing, and 2 ms of events
# at any rate this source keeps up with fill a small part of the default buffer.
GATHER_SECONDS = 0.002


class Datagrams:
    """A netlink socket's datagrams, read in batches: netlink delivers one event per datagram, and a
    busy source would pay a system call (and Python's socket machinery) for each. `recvmmsg` takes up to
    `slots` queued datagrams in one call, without waiting; `poll` waits only when nothing is queued.
    Each datagram lands in a slot of `slot_bytes`, larger than any these sockets receive (NFLOG batches
    up to a page; a conntrack event is a few hundred bytes); one that did not fit is an error, never
    a silently shortened message."""

    def __init__(self, sock: socket.socket, *, slots: int = 64, slot_bytes: int = 16 << 10) -> None:
        sock.setblocking(False)
        self.sock, self._fd = sock, sock.fileno()
        self.slot_bytes = slot_bytes
        self._buffer = (ctypes.c_char * (slots * slot_bytes))()
        self._view = memoryview(self._buffer).cast("B")
        base = ctypes.addressof(self._buffer)
        self._iovecs = (_Iovec * slots)(*[_Iovec(base + i * slot_bytes, slot_bytes) for i in range(slots)])
        self._messages = (_Mmsghdr * slots)()
        for i in range(slots):
            self._messages[i].header.iov = ctypes.pointer(self._iovecs[i])
            self._messages[i].header.iovlen = 1
        # What the kernel wrote back, read for a whole batch in one unpack rather than through ctypes'
        # objects (one per field per datagram cost about as much as parsing the datagram).
        self._results = memoryview(self._messages).cast("B")
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def next(self, timeout: float) -> list[bytes]:
        """The datagrams queued, waiting up to `timeout` seconds for one (none if none came);
        OSError(ENOBUFS) when some were lost."""
        data = self.queued()
        if not data and self._poll.poll(timeout * 1000):
            time.sleep(GATHER_SECONDS)
            data = self.queued()
        return data

    def queued(self) -> list[bytes]:
        """The datagrams already queued (at most one batch), without waiting."""
        received = _recvmmsg(self._fd, self._messages, len(self._messages), MSG_DONTWAIT, None)
        if received < 0:
            number = ctypes.get_errno()
            if number in (errno.EAGAIN, errno.EWOULDBLOCK):
                return []
            raise OSError(number, os.strerror(number))
        datagrams = []
        view, size = self._view, self.slot_bytes
        start = 0
        for flags, length in _RESULT.iter_unpack(self._results[: received * _RESULT.size]):
            if flags & MSG_TRUNC:
                raise OSError(errno.EMSGSIZE, f"a netlink datagram was larger than {size} bytes")
            datagrams.append(bytes(view[start : start + length]))
            start += size
        return datagrams


def latest(*instants: float | None) -> float | None:
    known = [instant for instant in instants if instant is not None]
    return max(known) if known else None


def is_overrun(error: OSError) -> bool:
    return error.errno == errno.ENOBUFS


def drain_queued(datagrams: Datagrams, handle: Callable[[bytes], object]) -> None:
    """Hand every datagram queued on the socket to `handle`, without waiting, until the queue is empty. After
    ENOBUFS the kernel reports no further drop until the queue has been emptied, so a source that met
    an overrun reads it empty before it trusts the socket again. Under a flood that never pauses this
    reads on, counting, until it does."""
    while True:
        try:
            batch = datagrams.queued()
        except OSError as error:
            if not is_overrun(error):
                raise
            continue  # dropped again while draining: inside the gap being recorded
        if not batch:
            return
        for data in batch:
            handle(data)

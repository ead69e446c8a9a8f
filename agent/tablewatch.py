"""Watching the owned table through the kernel's nftables netlink group (NFNLGRP_NFTABLES).

Every committed nftables transaction is announced as one notification per object it touched,
each carrying the new ruleset generation in its header, followed by NFT_MSG_NEWGEN. Our own
atomic replace is one transaction holding `add table` + `delete table` + the new table, so it
shows a DELTABLE and then a NEWTABLE of `inet palisade` before its NEWGEN. An outside
`nft delete table inet palisade` (or `flush ruleset`) shows a DELTABLE with no NEWTABLE after it.
So the watcher judges each transaction by the LAST table event it held for our table: NEWTABLE
means present, DELTABLE absent. Intermediate states inside a transaction are never visible to
packets, and are never reported.

A full socket buffer drops notifications (ENOBUFS); the watcher then reports `unknown` and the
caller asks the kernel directly.
"""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Callable

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP = 1
NFNLGRP_NFTABLES = 7
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_NEWTABLE = 0
NFT_MSG_GETTABLE = 1
NFT_MSG_DELTABLE = 2
NFT_MSG_NEWGEN = 15
NFTA_TABLE_NAME = 1
NFPROTO_INET = 1
NLMSG_MIN_TYPE = 0x10  # below: NOOP, ERROR, DONE, OVERRUN
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLA_TYPE_MASK = 0x3FFF

_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_NFGENMSG = struct.Struct("!BBH")  # family, version, resource id (the generation, low 16 bits)
_NLATTR = struct.Struct("=HH")
RECEIVE_BUFFER = 4 * 1024 * 1024

PRESENT, ABSENT, UNKNOWN = "present", "absent", "unknown"


def _attributes(data: bytes, start: int, end: int) -> dict[int, bytes]:
    found = {}
    while start + _NLATTR.size <= end:
        length, kind = _NLATTR.unpack_from(data, start)
        if length < _NLATTR.size or start + length > end:
            break
        found[kind & NLA_TYPE_MASK] = data[start + _NLATTR.size : start + length]
        start += (length + 3) & ~3
    return found


def table_exists(family: int = NFPROTO_INET, name: str = "palisade", timeout: float = 5.0) -> bool:
    """Ask the kernel whether the table exists: one NFT_MSG_GETTABLE over netlink.

    libnftables answers the same question only after caching the whole ruleset (about 45 MB at
    10,000 rules, on every heartbeat); this asks for the one table and holds nothing."""
    value = name.encode() + b"\0"
    attribute = _NLATTR.pack(_NLATTR.size + len(value), NFTA_TABLE_NAME) + value
    body = _NFGENMSG.pack(family, 0, 0) + attribute + b"\0" * (-len(attribute) % 4)
    kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE
    request = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, NLM_F_REQUEST | NLM_F_ACK, 1, 0) + body
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER) as sock:
        sock.settimeout(timeout)
        sock.send(request)
        found = False
        while True:
            data = sock.recv(65536)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, reply, _, _, _ = _NLMSGHDR.unpack_from(data, offset)
                if reply == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", data, offset + _NLMSGHDR.size)
                    if code == 0:  # the acknowledgement, after the table itself if there was one
                        return found
                    if -code == errno.ENOENT:
                        return False
                    raise OSError(
                        -code, f"asking the kernel for table {name}: {errno.errorcode.get(-code, -code)}"
                    )
                found = found or reply == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE
                if length < _NLMSGHDR.size:
                    break
                offset += (length + 3) & ~3


class TableEvents:
    """Netlink bytes in, one verdict per committed transaction that touched the table out.
    Pure parsing, so it can be tested without a kernel."""

    def __init__(self, family: int = NFPROTO_INET, name: str = "palisade") -> None:
        self.family = family
        self.name = name.encode()
        self._last: str | None = None  # the table's state as of the last event of the open transaction
        self._generation: int | None = None

    def feed(self, data: bytes) -> list[str]:
        verdicts: list[str] = []
        offset = 0
        while offset + _NLMSGHDR.size <= len(data):
            length, kind, _flags, _seq, _port = _NLMSGHDR.unpack_from(data, offset)
            if length < _NLMSGHDR.size or offset + length > len(data):
                break
            if kind >= NLMSG_MIN_TYPE and kind >> 8 == NFNL_SUBSYS_NFTABLES:
                self._message(kind & 0xFF, data, offset + _NLMSGHDR.size, offset + length, verdicts)
            offset += (length + 3) & ~3
        return verdicts

    def reset(self) -> None:
        self._last = self._generation = None

    def _message(self, kind: int, data: bytes, start: int, end: int, verdicts: list[str]) -> None:
        if start + _NFGENMSG.size > end:
            return
        family, _version, generation = _NFGENMSG.unpack_from(data, start)
        if kind == NFT_MSG_NEWGEN:
            self._commit(verdicts)
            return
        if kind not in (NFT_MSG_NEWTABLE, NFT_MSG_DELTABLE) or family != self.family:
            return
        name = _attributes(data, start + _NFGENMSG.size, end).get(NFTA_TABLE_NAME, b"").rstrip(b"\0")
        if name != self.name:
            return
        if self._generation is not None and generation != self._generation:
            self._commit(verdicts)  # a NEWGEN went missing: close the previous transaction anyway
        self._generation = generation
        self._last = PRESENT if kind == NFT_MSG_NEWTABLE else ABSENT

    def _commit(self, verdicts: list[str]) -> None:
        if self._last is not None:
            verdicts.append(self._last)
        self.reset()


class TableWatcher:
    """A non-blocking netlink socket in the nftables group of this network namespace."""

    def __init__(self, family: int = NFPROTO_INET, name: str = "palisade") -> None:
        self.events = TableEvents(family, name)
        self.sock: socket.socket | None = None
        self._loop = None

    def open(self) -> TableWatcher:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
        try:
            sock.bind((0, 0))
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
            except OSError:
                pass  # the default buffer still works; an overflow is detected and recovered from
            sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, NFNLGRP_NFTABLES)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        return self

    def read(self) -> list[str]:
        """Verdicts from everything queued now: `present`, `absent`, or `unknown` after an overflow."""
        verdicts: list[str] = []
        while self.sock is not None:
            try:
                data = self.sock.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError as error:
                if error.errno != errno.ENOBUFS:
                    raise
                self.events.reset()
                verdicts.append(UNKNOWN)
                continue
            verdicts.extend(self.events.feed(data))
        return verdicts

    def attach(self, loop, callback: Callable[[str], None]) -> None:
        """Call `callback(verdict)` from `loop` for each verdict as it arrives."""

        def readable() -> None:
            try:
                verdicts = self.read()
            except OSError:
                verdicts = [UNKNOWN]
            for verdict in verdicts:
                callback(verdict)

        self._loop = loop
        loop.add_reader(self.sock.fileno(), readable)

    def close(self) -> None:
        if self.sock is None:
            return
        if self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
            self._loop = None
        self.sock.close()
        self.sock = None

"""Watching the owned table through the kernel's nftables netlink group (NFNLGRP_NFTABLES).

Every committed nftables transaction is announced as one notification per object it touched,
each carrying the new ruleset generation in its header, followed by NFT_MSG_NEWGEN. Our own
atomic replace is one transaction holding `add table` + `delete table` + the new table, so it
shows a DELTABLE and then a NEWTABLE of `inet palisade` before its NEWGEN. An outside
`nft delete table inet palisade` (or `flush ruleset`) shows a DELTABLE with no NEWTABLE after it.
So the watcher judges each transaction by the LAST table event it held for our table: NEWTABLE
means present, DELTABLE absent. Intermediate states inside a transaction are never visible to
packets, and are never reported.

The same group announces every rule, chain, set and set element another process adds to our table,
removes or replaces (each its own message, with the table's name): a transaction that touched our
table without replacing it whole is a hand edit, counted as `Changes` (agent/tablediff.py) for the
daemon to restore and report. Counter values change without notifications, and named counter or
quota objects (whose reset is announced as a new object) are not counted: counters are not drift.

A full socket buffer drops notifications (ENOBUFS); the watcher then reports `unknown` and the
caller asks the kernel directly.
"""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.tablediff import ADDED, CHANGED, REMOVED, Changes

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
NFT_SET_ELEM_INTERVAL_END = 0x1
NFT_OBJECT_COUNTER, NFT_OBJECT_QUOTA = 1, 2
# Message kind -> (object kind, verb, attribute naming the object); every one names its table in
# attribute 1. The kernel announces a `destroy` as a delete; the DESTROY kinds are here all the same.
_OBJECTS = {
    3: ("chain", ADDED, 3),
    5: ("chain", REMOVED, 3),
    27: ("chain", REMOVED, 3),
    6: ("rule", ADDED, 2),
    8: ("rule", REMOVED, 2),
    28: ("rule", REMOVED, 2),
    9: ("set", ADDED, 2),
    11: ("set", REMOVED, 2),
    29: ("set", REMOVED, 2),
    12: ("element", ADDED, 2),
    14: ("element", REMOVED, 2),
    30: ("element", REMOVED, 2),
    18: ("object", ADDED, 2),
    20: ("object", REMOVED, 2),
    31: ("object", REMOVED, 2),
    22: ("flowtable", ADDED, 2),
    24: ("flowtable", REMOVED, 2),
    32: ("flowtable", REMOVED, 2),
}
NFTA_SET_ELEM_LIST_ELEMENTS = 3
NFTA_SET_ELEM_FLAGS = 3
NFTA_OBJ_TYPE = 3
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


@dataclass
class Transaction:
    """What one committed transaction did to our table."""

    state: str | None = None  # the table's state after it, if it created or deleted the table
    deleted: bool = False  # it deleted the table (a replace deletes, then creates)
    changes: Changes = field(default_factory=Changes)  # rules, chains, sets, elements

    @property
    def created(self) -> bool:
        """Created (or updated) without being deleted first: an update if the table was there."""
        return not self.deleted and self.state == PRESENT

    @property
    def replaced(self) -> bool:
        """Deleted and created again in one transaction: a whole-table replace (ours, as a rule)."""
        return self.deleted and self.state == PRESENT


def _elements(data: bytes, start: int, end: int) -> int:
    """Elements in a set element message, an interval's closing element not counted (an address
    added to an interval set is announced as a start and an end)."""
    listed = _attributes(data, start, end).get(NFTA_SET_ELEM_LIST_ELEMENTS)
    if listed is None:
        return 0
    count = 0
    offset = 0
    while offset + _NLATTR.size <= len(listed):
        length, _kind = _NLATTR.unpack_from(listed, offset)
        if length < _NLATTR.size or offset + length > len(listed):
            break
        flags = _attributes(listed, offset + _NLATTR.size, offset + length).get(NFTA_SET_ELEM_FLAGS)
        if not (
            flags is not None
            and len(flags) >= 4
            and struct.unpack("!I", flags[:4])[0] & NFT_SET_ELEM_INTERVAL_END
        ):
            count += 1
        offset += (length + 3) & ~3
    return count


class TableEvents:
    """Netlink bytes in, one `Transaction` per committed transaction that touched the table out.
    Pure parsing, so it can be tested without a kernel."""

    def __init__(self, family: int = NFPROTO_INET, name: str = "palisade") -> None:
        self.family = family
        self.name = name.encode()
        self._open: Transaction | None = None  # the transaction being read, once it touched our table
        self._generation: int | None = None
        # Chains and sets the last whole-table replace created: a new chain or set of one of these
        # names is a change to it, not an addition.
        self._known: set[tuple[str, str]] = set()
        self._building: set[tuple[str, str]] = set()

    def feed(self, data: bytes) -> list[str]:
        """The table's state after each transaction that created or deleted it."""
        return [t.state for t in self.transactions(data) if t.state is not None]

    def transactions(self, data: bytes) -> list[Transaction]:
        done: list[Transaction] = []
        offset = 0
        while offset + _NLMSGHDR.size <= len(data):
            length, kind, _flags, _seq, _port = _NLMSGHDR.unpack_from(data, offset)
            if length < _NLMSGHDR.size or offset + length > len(data):
                break
            if kind >= NLMSG_MIN_TYPE and kind >> 8 == NFNL_SUBSYS_NFTABLES:
                self._message(kind & 0xFF, data, offset + _NLMSGHDR.size, offset + length, done)
            offset += (length + 3) & ~3
        return done

    def reset(self) -> None:
        self._open = self._generation = None
        self._building = set()

    def _message(self, kind: int, data: bytes, start: int, end: int, done: list[Transaction]) -> None:
        if start + _NFGENMSG.size > end:
            return
        family, _version, generation = _NFGENMSG.unpack_from(data, start)
        if kind == NFT_MSG_NEWGEN:
            self._commit(done)
            return
        is_table = kind in (NFT_MSG_NEWTABLE, NFT_MSG_DELTABLE)
        if family != self.family or not (is_table or kind in _OBJECTS):
            return
        body = start + _NFGENMSG.size
        attributes = _attributes(data, body, end)
        if attributes.get(NFTA_TABLE_NAME, b"").rstrip(b"\0") != self.name:
            return
        if self._generation is not None and generation != self._generation:
            self._commit(done)  # a NEWGEN went missing: close the previous transaction anyway
        self._generation = generation
        transaction = self._open = self._open or Transaction()
        if is_table:
            if kind == NFT_MSG_DELTABLE:
                transaction.deleted = True
                transaction.state = ABSENT
                transaction.changes = Changes()  # what went with the table is no edit of it
                self._building = set()
            else:  # created; or, without a delete before it, perhaps an existing table updated
                transaction.state = PRESENT  # (its flags: `dormant` switches it off; Transaction.created)
            return
        what, verb, name_attribute = _OBJECTS[kind]
        name = attributes.get(name_attribute, b"").rstrip(b"\0").decode(errors="replace")
        if transaction.deleted:  # the replace rebuilding the table: remember its chains and sets
            if what in ("chain", "set") and verb == ADDED:
                self._building.add((what, name))
            return
        if what in ("set", "element") and name.startswith("__"):
            return  # an anonymous set belongs to the rule that holds it, counted as that rule
        if what == "object":
            kind_of = attributes.get(NFTA_OBJ_TYPE, b"")
            if len(kind_of) >= 4 and struct.unpack("!I", kind_of[:4])[0] in (
                NFT_OBJECT_COUNTER,
                NFT_OBJECT_QUOTA,
            ):
                return
        if what == "rule":
            transaction.changes.add("chain", name, verb, "rule")
        elif what == "element":
            transaction.changes.add("set", name, verb, "element", _elements(data, body, end))
        elif verb == ADDED and (what, name) in self._known:
            transaction.changes.add(what, name, CHANGED)
        else:
            transaction.changes.add(what, name, verb)

    def _commit(self, done: list[Transaction]) -> None:
        transaction = self._open
        if transaction is not None:
            if transaction.replaced:
                self._known = self._building
            elif transaction.state == ABSENT:
                self._known = set()
            if transaction.state is not None or transaction.changes:
                done.append(transaction)
        self._open = self._generation = None
        self._building = set()


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
        return [t.state for t in self.read_transactions() if t.state is not None]

    def read_transactions(self) -> list[Transaction]:
        """Everything queued now; after an overflow, a Transaction whose state is `unknown`."""
        found: list[Transaction] = []
        while self.sock is not None:
            try:
                data = self.sock.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError as error:
                if error.errno != errno.ENOBUFS:
                    raise
                self.events.reset()
                found.append(Transaction(state=UNKNOWN))
                continue
            found.extend(self.events.transactions(data))
        return found

    def drain(self) -> list[Transaction]:
        """What is queued now, read at once (not when the loop next polls): after our own apply
        returns, its notifications are already here, since the kernel queues them before it answers."""
        try:
            return self.read_transactions()
        except OSError:
            return [Transaction(state=UNKNOWN)]

    def attach(self, loop, callback: Callable[[Transaction], None]) -> None:
        """Call `callback(transaction)` from `loop` for each transaction as it arrives."""

        def readable() -> None:
            for transaction in self.drain():
                callback(transaction)

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

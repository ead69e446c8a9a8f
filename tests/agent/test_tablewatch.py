"""The owned-table watcher: our atomic replace is not a delete; an outside delete is.

The parsing is checked on hand-built netlink messages; the real thing in a network namespace
(root), with the real dataplane and the real `nft` command.
"""

from __future__ import annotations

import queue
import struct
import subprocess
import threading

import pytest

from agent.tablewatch import (
    NFNL_SUBSYS_NFTABLES,
    NFPROTO_INET,
    NFT_MSG_DELTABLE,
    NFT_MSG_NEWGEN,
    NFT_MSG_NEWTABLE,
    TableEvents,
)
from tests.support.agent_helpers import document
from tests.support.netns import Lab, dataplane_call, require_namespace_lab

NFT_MSG_NEWCHAIN = 3
NFPROTO_IPV4 = 2


def message(kind: int, generation: int, *, family: int = NFPROTO_INET, name: str | None = None) -> bytes:
    payload = struct.pack("!BBH", family, 0, generation)
    if name is not None:
        value = name.encode() + b"\0"
        payload += struct.pack("=HH", 4 + len(value), 1) + value + b"\0" * (-len(value) % 4)
    return struct.pack("=IHHII", 16 + len(payload), NFNL_SUBSYS_NFTABLES << 8 | kind, 0, 0, 0) + payload


def new(gen: int, name: str = "palisade", **kw) -> bytes:
    return message(NFT_MSG_NEWTABLE, gen, name=name, **kw)


def delete(gen: int, name: str = "palisade", **kw) -> bytes:
    return message(NFT_MSG_DELTABLE, gen, name=name, **kw)


def gen(gen: int) -> bytes:
    return message(NFT_MSG_NEWGEN, gen, family=0)


def test_our_replace_is_present_not_absent():
    events = TableEvents()
    # add table (existing: no event) + delete table + the new table, one transaction.
    assert events.feed(delete(5) + new(5) + message(NFT_MSG_NEWCHAIN, 5) + gen(5)) == ["present"]
    # The very first apply: add, delete, add.
    assert events.feed(new(6) + delete(6) + new(6) + gen(6)) == ["present"]


def test_outside_delete_is_absent():
    assert TableEvents().feed(delete(7) + gen(7)) == ["absent"]


def test_other_tables_and_families_are_ignored():
    events = TableEvents()
    assert events.feed(delete(8, "other") + gen(8)) == []
    assert events.feed(delete(9, family=NFPROTO_IPV4) + gen(9)) == []
    assert events.feed(message(NFT_MSG_NEWCHAIN, 10) + gen(10)) == []


def test_a_transaction_split_over_several_reads():
    events = TableEvents()
    assert events.feed(delete(11)) == []
    assert events.feed(new(11)) == []
    assert events.feed(gen(11)) == ["present"]


def test_a_lost_newgen_still_closes_the_previous_transaction():
    events = TableEvents()
    assert events.feed(delete(12) + new(13) + gen(13)) == ["absent", "present"]


def test_truncated_input_is_not_a_crash():
    events = TableEvents()
    assert events.feed(delete(14)[:-3]) == []
    assert events.feed(b"\x01\x02") == []


# --- in a network namespace ---

WATCH = """
import select, sys
from agent.tablewatch import TableWatcher
watcher = TableWatcher().open()
print("ready", flush=True)
while True:
    select.select([watcher.sock], [], [])
    for verdict in watcher.read():
        print(verdict, flush=True)
"""


def _lines(process: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in process.stdout:
            lines.put(line.strip())

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _next(lines: queue.Queue, timeout: float = 10.0) -> str:
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"the watcher said nothing within {timeout} s") from None


@pytest.mark.root
def test_watcher_in_a_namespace():
    require_namespace_lab()
    with Lab.create({"wl": (None, None)}) as lab:
        watcher = lab.popen_python("wl", WATCH)
        try:
            lines = _lines(watcher)
            assert _next(lines) == "ready"

            assert dataplane_call(lab, "wl", "apply", document("v1"))["error"] is None
            assert _next(lines) == "present"
            for version in ("v2", "v3"):  # replaces through NftablesDataplane.apply
                assert dataplane_call(lab, "wl", "apply", document(version, port=2222))["error"] is None
                assert _next(lines) == "present"

            assert lab.run("wl", ["nft", "delete", "table", "inet", "palisade"]).returncode == 0
            assert _next(lines) == "absent"

            # Foreign tables come and go without a word about ours.
            assert lab.run("wl", ["nft", "add", "table", "ip", "palisade"]).returncode == 0
            assert lab.run("wl", ["nft", "add", "table", "inet", "other"]).returncode == 0
            assert lab.run("wl", ["nft", "delete", "table", "inet", "other"]).returncode == 0
            assert dataplane_call(lab, "wl", "apply", document("v4"))["error"] is None
            assert _next(lines) == "present"

            assert lab.run("wl", ["nft", "flush", "ruleset"]).returncode == 0
            assert _next(lines) == "absent"
            assert lines.empty()
        finally:
            watcher.kill()
            watcher.wait(10)

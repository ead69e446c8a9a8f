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

from agent.tablediff import describe
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


def attribute(kind: int, value: bytes) -> bytes:
    return struct.pack("=HH", 4 + len(value), kind) + value + b"\0" * (-len(value) % 4)


def text(value: str) -> bytes:
    return value.encode() + b"\0"


def object_message(kind: int, generation: int, *attributes: bytes, table: str = "palisade") -> bytes:
    payload = (
        struct.pack("!BBH", NFPROTO_INET, 0, generation) + attribute(1, text(table)) + b"".join(attributes)
    )
    return struct.pack("=IHHII", 16 + len(payload), NFNL_SUBSYS_NFTABLES << 8 | kind, 0, 0, 0) + payload


def rule(kind: int, generation: int, chain: str = "input", **kw) -> bytes:
    return object_message(kind, generation, attribute(2, text(chain)), **kw)


def element(kind: int, generation: int, set_name: str, *flags: int) -> bytes:
    listed = b"".join(
        attribute(1 | 0x8000, attribute(1, b"\0" * 8) + (attribute(3, struct.pack("!I", f)) if f else b""))
        for f in flags
    )
    return object_message(kind, generation, attribute(2, text(set_name)), attribute(3 | 0x8000, listed))


def test_a_rule_added_by_hand_is_a_change_not_a_state():
    events = TableEvents()
    (done,) = events.transactions(rule(6, 20) + gen(20))
    assert done.state is None and not done.replaced and describe(done.changes) == "chain input: 1 rule added"
    assert events.feed(rule(6, 21) + gen(21)) == []  # no present/absent verdict for an edit


def test_an_interval_element_is_one_element_and_anonymous_sets_belong_to_their_rule():
    events = TableEvents()
    (done,) = events.transactions(element(12, 22, "allow_v4_3", 0, 1) + gen(22))
    assert describe(done.changes) == "set allow_v4_3: 1 element added"
    (done,) = events.transactions(element(12, 23, "__set0", 0, 0) + rule(6, 23) + gen(23))
    assert describe(done.changes) == "chain input: 1 rule added"


def test_what_our_replace_rebuilds_is_no_change_and_names_what_exists():
    events = TableEvents()
    ours = (
        rule(8, 24) + delete(24) + new(24) + object_message(3, 24, attribute(3, text("input"))) + rule(6, 24)
    )
    (done,) = events.transactions(ours + gen(24))
    assert done.replaced and not done.changes
    # A chain the replace created, announced again: changed (its policy, say), not added.
    (done,) = events.transactions(object_message(3, 25, attribute(3, text("input"))) + gen(25))
    assert describe(done.changes) == "chain input changed"
    (done,) = events.transactions(object_message(3, 26, attribute(3, text("extra"))) + gen(26))
    assert describe(done.changes) == "chain extra added"


def test_counter_objects_and_other_tables_are_not_changes():
    events = TableEvents()
    counter = object_message(18, 27, attribute(2, text("hits")), attribute(3, struct.pack("!I", 1)))
    assert events.transactions(counter + rule(6, 27, table="other") + gen(27)) == []


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


EDITS = """
import select
from agent.tablewatch import TableWatcher
from agent.tablediff import describe
watcher = TableWatcher().open()
print("ready", flush=True)
while True:
    select.select([watcher.sock], [], [])
    for t in watcher.read_transactions():
        print("replaced" if t.replaced else t.state or describe(t.changes), flush=True)
"""

SET_DOCUMENT = """table inet palisade {
  set allow_v4_3 {
    type ipv4_addr
    flags interval
    auto-merge
    elements = { 10.1.0.0/16, 10.9.9.9 }
  }
  chain input {
    type filter hook input priority 0; policy accept;
    ip saddr @allow_v4_3 tcp dport 22 accept
    tcp dport 22 drop
  }
}
"""


@pytest.mark.root
def test_hand_edits_in_a_namespace_are_described_and_counters_are_not():
    require_namespace_lab()
    with Lab.create({"wl": (None, None)}) as lab:
        watcher = lab.popen_python("wl", EDITS)
        try:
            lines = _lines(watcher)
            assert _next(lines) == "ready"
            assert dataplane_call(lab, "wl", "apply", SET_DOCUMENT)["error"] is None
            assert _next(lines) == "replaced"
            for command, said in [
                ("add rule inet palisade input tcp dport 9090 accept", "chain input: 1 rule added"),
                (
                    "insert rule inet palisade input ip saddr { 1.2.3.4, 5.6.7.8 } accept",
                    "chain input: 1 rule added",
                ),
                ("reset counters table inet palisade", None),
                ("add element inet palisade allow_v4_3 { 10.88.0.1 }", "set allow_v4_3: 1 element added"),
                ("delete element inet palisade allow_v4_3 { 10.9.9.9 }", "set allow_v4_3: 1 element removed"),
                ("flush chain inet palisade input", "chain input: 4 rules removed"),
                ("chain inet palisade input { policy drop; }", "chain input changed"),
                ("add chain inet palisade extra", "chain extra added"),
            ]:
                assert lab.run("wl", ["nft", *command.split()]).returncode == 0, command
                if said is not None:
                    assert _next(lines) == said, command
            assert dataplane_call(lab, "wl", "apply", SET_DOCUMENT)["error"] is None
            assert _next(lines) == "replaced"
            assert lines.empty()
        finally:
            watcher.kill()
            watcher.wait(10)


QUEUED_BEFORE_APPLY_RETURNS = """
from agent.dataplane import NftablesDataplane
from agent.tablewatch import TableWatcher
from tests.support.agent_helpers import document
watcher = TableWatcher().open()
dataplane = NftablesDataplane()
for version in range(20):
    dataplane.apply(document(f"v{version}", port=1000 + version))
    found = watcher.drain()  # at once: no wait, no poll
    assert [t.replaced for t in found] == [True], (version, found)
print("ok", flush=True)
"""


@pytest.mark.root
def test_our_replace_is_announced_before_apply_returns():
    """What lets the daemon tell its own replaces from another process's: their notifications are
    queued on the watcher's socket by the time apply() returns, so a read right then finds them."""
    require_namespace_lab()
    with Lab.create({"wl": (None, None)}) as lab:
        done = lab.python("wl", QUEUED_BEFORE_APPLY_RETURNS)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr

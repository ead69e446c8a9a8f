"""Counting conntrack entries once (agent/conntrack.py's ConntrackCounter), on entries built in
memory: what a dump, NEW and DESTROY each count, and what the counter forgets."""

from __future__ import annotations

from agent import conntrack
from agent.flowwindow import Windows

ALLOWED = (2 << 24) | 7


def entry(ident: int, *, destroyed: bool = False, sport: int = 40000, bytes_=(None, None)) -> conntrack.Entry:
    return conntrack.Entry(
        destroyed, ident, 6, "10.0.0.2", "10.0.0.1", 443, sport + ident, ALLOWED, *bytes_, None
    )


def counter() -> conntrack.ConntrackCounter:
    return conntrack.ConntrackCounter(Windows(length=3600, max_keys=1000, accounting=True))


def total(counting: conntrack.ConntrackCounter) -> tuple[int, int]:
    closed, _ = counting.windows.close_due(float("inf"), "v1")
    groups = [c for w in closed for _, c in w.groups]
    return sum(c.connection_count for c in groups), sum(c.bytes_in for c in groups)


def test_each_connection_counts_once_whichever_message_saw_it_first():
    counting = counter()
    counting.subscribed([entry(1)], 10.0)  # live at subscribe
    counting.events([entry(1), entry(2)], 11.0)  # 1 again (its NEW raced the dump), 2 new
    counting.events([entry(3, destroyed=True, bytes_=(5, 6))], 12.0)  # NEW lost: counted at its end
    counting.events([entry(1, destroyed=True), entry(2, destroyed=True)], 13.0)
    assert total(counting) == (3, 5)
    assert counting.counted == {}


def test_a_complete_dump_forgets_what_ended_unheard_and_still_recognises_a_late_destroy():
    counting = counter()
    counting.events([entry(n) for n in range(1, 5)], 10.0)
    # 2's DESTROY was lost (an overrun); 3 ended while the dump ran: its DESTROY comes after the dump.
    counting.subscribed([entry(1), entry(4)], 20.0)
    assert set(counting.counted) == {conntrack._identity(entry(1)), conntrack._identity(entry(4))}
    counting.events([entry(3, destroyed=True, bytes_=(7, 8))], 21.0)
    assert total(counting) == (4, 7)  # 3 not counted again; its bytes kept
    counting.subscribed([entry(1), entry(4)], 30.0)
    assert counting.ended == {}  # 2 is forgotten for good: memory holds what is live


def test_a_truncated_dump_forgets_nothing():
    counting = counter()
    counting.events([entry(1), entry(2)], 10.0)
    counting.subscribed([entry(1)], 20.0, complete=False)  # 2 may be live beyond the bound
    counting.events([entry(2, destroyed=True)], 21.0)
    assert total(counting) == (2, 0)

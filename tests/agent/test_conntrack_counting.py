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
    counting.events([entry(1, destroyed=True, bytes_=(1, 1)), entry(2, destroyed=True, bytes_=(2, 2))], 13.0)
    assert total(counting) == (3, 8)
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


def test_a_connection_ending_without_counters_makes_its_window_count_no_bytes_rather_than_too_few():
    """Accounting switched on or off while the agent runs: a connection's counters exist only if it
    was on when the connection opened. A window whose bytes would fall short says "not counted"."""
    counting = counter()  # accounting on
    counting.events([entry(1), entry(2)], 10.0)
    counting.events([entry(1, destroyed=True, bytes_=(100, 200))], 11.0)
    counting.events([entry(3, destroyed=True, bytes_=(5, 6))], 12.0)  # only its end seen: counted now
    (window,), _ = counting.windows.close_due(3600.0, "v1")
    assert window.accounting is True and sum(c.bytes_in for _, c in window.groups) == 105

    counting.events([entry(4)], 3700.0)
    counting.events([entry(2, destroyed=True, bytes_=(7, 8))], 3701.0)  # bytes of a connection opened earlier
    counting.events([entry(4, destroyed=True)], 3702.0)  # opened with accounting off: no counters
    (window,), _ = counting.windows.close_due(7200.0, "v1")
    assert window.accounting is False
    assert [(c.connection_count, c.bytes_in, c.bytes_out) for _, c in window.groups] == [(1, 0, 0)]


def test_windows_opened_after_accounting_changes_follow_it():
    counting = counter()
    counting.windows.accounting = False  # as the source reads the setting, once a second
    counting.events([entry(1)], 10.0)
    counting.events([entry(1, destroyed=True, bytes_=(100, 200))], 11.0)
    (window,), _ = counting.windows.close_due(3600.0, "v1")
    assert window.accounting is False and [c.bytes_in for _, c in window.groups] == [0]

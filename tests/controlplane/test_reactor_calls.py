"""Calls onto the reactor's thread (controlplane/reactor_calls.py): in order, on the loop's thread, one
wakeup for all the calls made while the loop was busy, and a failing call stops none after it."""

from __future__ import annotations

import asyncio
import threading

import pytest
import twisted.internet

from controlplane.reactor_calls import reactor_call


class CountingLoop:
    """An asyncio loop on a thread of its own, counting the wakeups asked of it from other threads."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.wakeups = 0
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call_soon_threadsafe(self, callback, *args):
        self.wakeups += 1
        return self.loop.call_soon_threadsafe(callback, *args)

    def hold(self) -> threading.Event:
        """Keep the loop busy until the returned event is set."""
        busy, release = threading.Event(), threading.Event()

        def block():
            busy.set()
            release.wait(10)

        self.loop.call_soon_threadsafe(block)
        assert busy.wait(10)
        return release

    def settle(self) -> None:
        done = threading.Event()
        self.loop.call_soon_threadsafe(done.set)
        assert done.wait(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class FakeReactor:
    def __init__(self, loop: CountingLoop) -> None:
        self._asyncioEventloop = loop


@pytest.fixture
def loop(monkeypatch):
    counting = CountingLoop()
    monkeypatch.setattr(twisted.internet, "reactor", FakeReactor(counting), raising=False)
    yield counting
    counting.close()


def test_calls_from_many_threads_run_on_the_loops_thread_each_threads_in_order(loop):
    ran: list[tuple[int, int, threading.Thread]] = []

    def record(sender: int, index: int) -> None:
        ran.append((sender, index, threading.current_thread()))

    def send(sender: int) -> None:
        for index in range(200):
            reactor_call(record, sender, index)

    senders = [threading.Thread(target=send, args=(n,)) for n in range(4)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(10)
    loop.settle()
    assert len(ran) == 800
    assert {thread for _, _, thread in ran} == {loop.thread}
    for sender in range(4):
        assert [index for n, index, _ in ran if n == sender] == list(range(200))


def test_the_calls_made_while_the_loop_is_busy_take_one_wakeup(loop):
    ran: list[int] = []
    release = loop.hold()
    before = loop.wakeups
    for index in range(100):
        reactor_call(ran.append, index)
    assert loop.wakeups - before == 1 and ran == []
    release.set()
    loop.settle()
    assert ran == list(range(100))

    reactor_call(ran.append, 100)  # the loop idle again: the next call wakes it
    loop.settle()
    assert ran[-1] == 100 and loop.wakeups - before == 2


def test_a_failing_call_is_logged_and_the_next_still_runs(loop, caplog):
    ran: list[str] = []

    def fail() -> None:
        raise ValueError("broken")

    release = loop.hold()
    reactor_call(fail)
    reactor_call(ran.append, "after")
    release.set()
    loop.settle()
    assert ran == ["after"]
    assert "a call on the reactor's thread failed" in caplog.text and "broken" in caplog.text

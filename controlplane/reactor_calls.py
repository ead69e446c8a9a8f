"""Calls from serve's other threads onto the reactor's thread, in the order they were made.

Twisted's `reactor.callFromThread` on the asyncio reactor schedules a `callLater(0)`: a DelayedCall on
Twisted's heap, the asyncio timer moved, then `runUntilCurrent` to find it, for each call. A busy gateway
makes two such calls per flow report (the body gate's header check, the report's answer), and that
bookkeeping was about 8 % of the reactor thread's samples (py-spy, docs/benchmarks.md). Here the calls queue, and one wakeup of the event
loop runs all that arrived while it was busy, directly on the loop (the reactor's own thread).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger("palisade.serve")

_calls: deque[tuple[Callable, tuple]] = deque()
_lock = threading.Lock()
_wakeup_pending = False


def reactor_call(function: Callable, *args) -> None:
    """Run `function(*args)` on the reactor's thread, after every call made here before it."""
    global _wakeup_pending
    from twisted.internet import reactor

    loop = getattr(reactor, "_asyncioEventloop", None)
    if loop is None:  # another reactor (never serve's): Twisted's own way
        reactor.callFromThread(function, *args)
        return
    with _lock:
        _calls.append((function, args))
        if _wakeup_pending:
            return
        _wakeup_pending = True
    loop.call_soon_threadsafe(_run_calls)


def _run_calls() -> None:
    global _wakeup_pending
    with _lock:
        _wakeup_pending = False
        calls = list(_calls)
        _calls.clear()
    for function, args in calls:
        try:
            function(*args)
        except Exception:  # as Twisted logs a failed call and runs the next
            log.exception("a call on the reactor's thread failed")

"""Admission of agents' sync streams: a bound on the authentications one serve process has in progress.

Without it, a process offered more streams than it can authenticate within the agents' handshake
time (a failover of thousands, a fleet starting together) accepted them all, spent its CPU on
handshakes whose agent had already given up, and completed almost none. Past the bound a new stream
is refused at once, before any database or Ed25519 work, with close 4503 and `retry after N s`; the
agent waits exactly N s (agent/daemon.py), so N is what spaces the fleet out.

N is a slot in a schedule: the refused are given return times one after the other, at the rate this
process has been completing authentications lately, so that they come back about as fast as it can
take them instead of all together after the same wait. The schedule empties as time catches up with
it. Everything here runs on the event loop's thread: no locks.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

# How far back the completion rate is measured.
RATE_WINDOW_SECONDS = 10.0
# Before any completion is seen (a storm at start, or right after a failover), the rate assumed:
# the bound's worth of authentications every this many seconds.
ASSUMED_SECONDS_PER_BOUND = 2.0
# The agent honours up to 600 s (agent.protocol.MAX_RETRY_AFTER_SECONDS); no one waits this long here.
MAX_WAIT_SECONDS = 300
MIN_WAIT_SECONDS = 1


class StreamAdmission:
    """How many stream authentications are in progress, and the wait told to those refused."""

    def __init__(self, *, limit: int, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.clock = clock
        self.in_progress = 0
        self.refused = 0  # since the start: the metric reads it
        self._completed: deque[float] = deque()
        self._next_slot = 0.0

    def enter(self) -> int | None:
        """None: admitted (leave() follows, once). Otherwise the seconds the refused agent should wait."""
        if self.limit <= 0 or self.in_progress < self.limit:
            self.in_progress += 1
            return None
        self.refused += 1
        now = self.clock()
        slot = max(self._next_slot, now + MIN_WAIT_SECONDS)
        self._next_slot = min(slot + 1.0 / self.rate(now), now + MAX_WAIT_SECONDS)
        return min(max(MIN_WAIT_SECONDS, math.ceil(slot - now)), MAX_WAIT_SECONDS)

    def leave(self, *, completed: bool) -> None:
        """An admitted authentication ended: `completed` when the stream was granted."""
        self.in_progress -= 1
        if completed:
            self._completed.append(self.clock())

    def rate(self, now: float) -> float:
        """Authentications completed a second, lately; never below the assumed rate."""
        horizon = now - RATE_WINDOW_SECONDS
        while self._completed and self._completed[0] < horizon:
            self._completed.popleft()
        assumed = max(self.limit, 1) / ASSUMED_SECONDS_PER_BOUND
        return max(len(self._completed) / RATE_WINDOW_SECONDS, assumed)


_admission: StreamAdmission | None = None


def stream_admission() -> StreamAdmission:
    """This process's admission, with the bound of the settings."""
    global _admission
    if _admission is None:
        from django.conf import settings

        _admission = StreamAdmission(limit=settings.PALISADE_STREAM_AUTHENTICATIONS)
    return _admission

"""Admission of agents' sync streams: a bound on the authentications one serve process has in progress.

Without it, a process offered more streams than it can authenticate within the agents' handshake
time (a failover of thousands, a fleet starting together) accepted them all, spent its CPU on
handshakes whose agent had already given up, and completed almost none. Past the bound a new stream
is refused at once, before any database or Ed25519 work, with close 4503 and `retry after N s`; the
agent waits exactly N s (agent/daemon.py), so N is what spaces the fleet out.

N is a slot in a schedule: the refused are given return times one after the other, at the rate this
process can complete authentications, so that they come back about as fast as it can take them
instead of all together after the same wait. That rate is the bound over how long an authentication
has taken lately (Little's law: with `limit` in progress, each taking d seconds, limit / d complete a
second), or what completed over the last 10 s if more. The duration is known from the first few
streams, also right after a failover, where counting completions would lag behind (a process that
had completed none was taken for one completing few, and its refused were given waits of half a
minute while it idled). The schedule empties as time catches up with it. Everything here runs on the
event loop's thread: no locks.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

# How far back the completion rate is measured.
RATE_WINDOW_SECONDS = 10.0
# Before any authentication has completed, the duration assumed; then a moving average of the
# durations, each new one weighing this much.
ASSUMED_DURATION_SECONDS = 0.5
DURATION_WEIGHT = 0.05
# The agent honours up to 600 s (agent.protocol.MAX_RETRY_AFTER_SECONDS); no one waits this long here.
MAX_WAIT_SECONDS = 300
MIN_WAIT_SECONDS = 1


class StreamAdmission:
    """How many stream authentications are in progress, and the wait told to those refused."""

    def __init__(self, *, limit: int, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.clock = clock
        self.in_progress = 0
        self.refused = 0  # since the start (the metric is counted where the refusal is sent)
        self._completed: deque[float] = deque()
        self._next_slot = 0.0
        self.duration = ASSUMED_DURATION_SECONDS

    def enter(self) -> int | None:
        """None: admitted (leave() follows, once, with the clock's reading returned by began()).
        Otherwise the seconds the refused agent should wait."""
        if self.limit <= 0 or self.in_progress < self.limit:
            self.in_progress += 1
            return None
        self.refused += 1
        now = self.clock()
        slot = max(self._next_slot, now + MIN_WAIT_SECONDS)
        self._next_slot = min(slot + 1.0 / self.rate(now), now + MAX_WAIT_SECONDS)
        return min(max(MIN_WAIT_SECONDS, math.ceil(slot - now)), MAX_WAIT_SECONDS)

    def leave(self, *, began: float, completed: bool) -> None:
        """An admitted authentication that began at `began` (the clock's reading) ended: `completed`
        when the stream was granted."""
        self.in_progress -= 1
        if completed:
            now = self.clock()
            self._completed.append(now)
            self.duration += DURATION_WEIGHT * (max(now - began, 0.001) - self.duration)

    def rate(self, now: float) -> float:
        """Authentications this process completes a second: the bound over their recent duration, or
        what completed over the last 10 s if more."""
        horizon = now - RATE_WINDOW_SECONDS
        while self._completed and self._completed[0] < horizon:
            self._completed.popleft()
        return max(len(self._completed) / RATE_WINDOW_SECONDS, max(self.limit, 1) / self.duration)


_admission: StreamAdmission | None = None


def stream_admission() -> StreamAdmission:
    """This process's admission, with the bound of the settings."""
    global _admission
    if _admission is None:
        from django.conf import settings

        _admission = StreamAdmission(limit=settings.PALISADE_STREAM_AUTHENTICATIONS)
    return _admission

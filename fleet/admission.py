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

A place is held at most HOLD_SECONDS: the gateway refuses an agent that has not authenticated within
its handshake time (10 s), so a place held longer belongs to a stream that ended without leaving. At
10,000 simulated agents a process was seen with every place held and at most 11 streams authenticating,
refusing everyone for ten minutes; how its streams ended unseen is not known. Such places are released
(and logged) rather than shrinking the bound for good.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable

log = logging.getLogger("palisade.gateway")

# How far back the completion rate is measured.
RATE_WINDOW_SECONDS = 10.0
# Before any authentication has completed, the duration assumed; then a moving average of the
# durations, each new one weighing this much.
ASSUMED_DURATION_SECONDS = 0.5
DURATION_WEIGHT = 0.05
# The agent honours up to 600 s (agent.protocol.MAX_RETRY_AFTER_SECONDS); no one waits this long here.
MAX_WAIT_SECONDS = 300
MIN_WAIT_SECONDS = 1
# Three times the gateway's handshake time (fleet.gateway.AUTH_TIMEOUT_SECONDS): see above.
HOLD_SECONDS = 30.0


class StreamAdmission:
    """How many stream authentications are in progress, and the wait told to those refused."""

    def __init__(self, *, limit: int, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.clock = clock
        self._held: OrderedDict[Hashable, float] = OrderedDict()  # holder -> admitted at, oldest first
        self.refused = 0  # since the start (the metric is counted where the refusal is sent)
        self.released_stale = 0  # places held past HOLD_SECONDS, since the start
        self._completed: deque[float] = deque()
        self._next_slot = 0.0
        self.duration = ASSUMED_DURATION_SECONDS

    @property
    def in_progress(self) -> int:
        return len(self._held)

    def enter(self, holder: Hashable) -> int | None:
        """None: `holder` is admitted (`leave(holder, ...)` follows). Otherwise the seconds the refused
        agent should wait."""
        now = self.clock()
        self._release_stale(now)
        if self.limit <= 0 or len(self._held) < self.limit:
            self._held[holder] = now
            return None
        self.refused += 1
        slot = max(self._next_slot, now + MIN_WAIT_SECONDS)
        self._next_slot = min(slot + 1.0 / self.rate(now), now + MAX_WAIT_SECONDS)
        return min(max(MIN_WAIT_SECONDS, math.ceil(slot - now)), MAX_WAIT_SECONDS)

    def leave(self, holder: Hashable, *, completed: bool) -> None:
        """`holder`'s authentication ended: `completed` when the stream was granted. Nothing when its
        place was released already."""
        began = self._held.pop(holder, None)
        if began is not None and completed:
            now = self.clock()
            self._completed.append(now)
            self.duration += DURATION_WEIGHT * (max(now - began, 0.001) - self.duration)

    def _release_stale(self, now: float) -> None:
        released = 0
        while self._held and next(iter(self._held.values())) < now - HOLD_SECONDS:
            self._held.popitem(last=False)
            released += 1
        if released:
            self.released_stale += released
            log.warning(
                "released %d places of the stream admission held past %g s (their streams ended without "
                "leaving; %d since the start)",
                released,
                HOLD_SECONDS,
                self.released_stale,
            )

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

"""How long the agent waits before it tries the gateway again: its sync stream (agent/daemon.py) and its
flow reports (agent/flowreporter.py) back off by the same rule.

Full jitter over 1 s doubling to 60 s with each failed attempt. When the gateway said when to come back
(a 429's or 503's Retry-After, a 4503's reason), no sooner than that. A stream the gateway turned away
as it accepted the connection (reset before TLS: up, but at its bound on unfinished handshakes), or
took the connection and did not finish the handshake in time (queued behind others), or whose TCP
connection timed out (a full listen queue drops the SYN; a gone host looks the same), doubles
to 15 s only: the gateway finishes the handshakes it admitted within seconds and has room again, and a
refusal costs it an accept and a close; at 60 s the last agents of a failover waited a minute in front
of an idle survivor.
"""

from __future__ import annotations

import random

BACKOFF_FIRST, BACKOFF_CAP = 1.0, 60.0
BUSY_CAP = 15.0


def backoff_delay(attempt: int, rng: random.Random | None = None, cap: float = BACKOFF_CAP) -> float:
    """Full jitter: uniform in [0, min(cap, 1 * 2**attempt)] seconds (attempt counts from 0)."""
    ceiling = min(cap, BACKOFF_FIRST * 2 ** min(attempt, 16))
    return (rng or random).uniform(0, ceiling)


def retry_delay(
    attempt: int,
    retry_after: float | None,
    *,
    spread: bool = True,
    rng: random.Random | None = None,
    cap: float = BACKOFF_CAP,
) -> float:
    """Seconds until the next attempt after `attempt` failed ones: the backoff; and when the gateway
    asked for `retry_after` seconds, no sooner than that. `spread` spreads that wait over as long again,
    and keeps the backoff when it is the longer wait: a fleet told to wait together (a flow report's
    `Retry-After: 1` when the gateway has no room for its body) does not come back together. Without
    it, the wait is exactly what the gateway asked for (the stream's: the gateway draws it at random
    for each answer already)."""
    if retry_after is not None and not spread:
        return retry_after
    delay = backoff_delay(attempt, rng, cap)
    if retry_after is not None:
        delay = max(delay, retry_after * (rng or random).uniform(1, 2))
    return delay

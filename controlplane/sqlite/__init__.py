"""The embedded SQLite database, as serve uses it: Django's backend with writers taking turns.

SQLite has one writer at a time for the whole file. Its own wait for that lock (the busy handler)
retries on a timer, so a writer that commits and begins again at once (group commit under load) takes
the lock back before the others wake: they starved until their timeout and failed with "database is
locked", which answered 500 and crashed streams. Here every write of this process, a transaction or a
single statement outside one, first takes its turn at a first-come, first-served turnstile (`base.py`),
so writers are served in the order they asked; SQLite's own busy handler then only waits for another
process (a host command).

How long a writer waits for its turn is the thread's `database_wait` (PALISADE_SQLITE_WAIT_SECONDS
unless a caller says less: flow reports wait PALISADE_SQLITE_REPORT_WAIT_SECONDS and are answered 503
with Retry-After past it, which agents honour and re-send). A wait that runs out raises the same
`OperationalError` SQLite gives ("database is locked"), which `controlplane.outage` recognises as the
database busy: a 503 with Retry-After, never a 500.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_waits = threading.local()


def write_wait_seconds(default: float) -> float:
    """How long this thread's writes wait for their turn: its `database_wait`, else `default`."""
    return getattr(_waits, "seconds", default)


@contextmanager
def database_wait(seconds: float) -> Iterator[None]:
    """Writes on this thread wait at most `seconds` for their turn at the embedded database (no effect on
    PostgreSQL, whose writers wait for the rows they touch, not for the whole database)."""
    before = getattr(_waits, "seconds", None)
    _waits.seconds = seconds
    try:
        yield
    finally:
        if before is None:
            del _waits.seconds
        else:
            _waits.seconds = before

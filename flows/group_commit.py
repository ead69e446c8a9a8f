"""Group commit: callers on many threads hand their items to whichever of them writes next, so one
write (one transaction, a few statements, one commit) stores everything that arrived while the
previous write ran. Under load that is many reports per transaction; alone, a caller writes its own
item at once, with no wait and no extra thread.

At most one item per key goes into a write (a workload's reports are written one after another, in the
order they arrived), and items up to a total weight (a report's keys: a write's transaction stays
short, which on SQLite is how long every other writer waits). A write that fails as a whole is retried
item by item, so one bad item fails only its own caller; a failure that is no item's fault (the
database away or busy) is every caller's at once, since retrying each alone would wait as long again
per item.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class _Entry:
    item: Any
    key: Hashable
    weight: int = 1
    done: bool = False
    outcome: Any = None


class GroupCommit:
    def __init__(
        self,
        write: Callable[[list[Any]], Sequence[Any]],
        *,
        key: Callable[[Any], Hashable],
        most: int,
        weight: Callable[[Any], int] = lambda item: 1,
        most_weight: int | None = None,
        shared_failure: Callable[[Exception], bool] = lambda error: False,
    ) -> None:
        """`write` stores a list of items and returns one outcome per item, in order; an outcome that
        is an exception is raised to that item's caller. A write takes at most `most` items and, past
        its first, items up to `most_weight` in all. A write failing with an error that
        `shared_failure` accepts fails each of its items with that error, untried alone."""
        self._write, self._key, self._most = write, key, most
        self._weight, self._most_weight, self._shared_failure = weight, most_weight, shared_failure
        self._queue: list[_Entry] = []
        self._queue_lock = threading.Lock()
        self._writing = threading.Lock()

    def submit(self, item: Any) -> Any:
        entry = _Entry(item, self._key(item), self._weight(item))
        with self._queue_lock:
            self._queue.append(entry)
        while not entry.done:
            with self._writing:
                if not entry.done:
                    self._run(self._take())
        if isinstance(entry.outcome, BaseException):
            raise entry.outcome
        return entry.outcome

    def _take(self) -> list[_Entry]:
        """The oldest entries, one per key, up to the limits; the rest wait for the next write (a key
        whose entry waits has none taken after it: its items keep their order)."""
        with self._queue_lock:
            batch: list[_Entry] = []
            left: list[_Entry] = []
            keys: set[Hashable] = set()
            weight = 0
            for entry in self._queue:
                fits = not batch or self._most_weight is None or weight + entry.weight <= self._most_weight
                if len(batch) < self._most and entry.key not in keys and fits:
                    batch.append(entry)
                    weight += entry.weight
                else:
                    left.append(entry)
                keys.add(entry.key)
            self._queue = left
        return batch

    def _run(self, batch: list[_Entry]) -> None:
        try:
            outcomes = self._write([entry.item for entry in batch])
        except Exception as error:  # noqa: BLE001  (handed to the caller it belongs to)
            if len(batch) == 1 or self._shared_failure(error):
                outcomes = [error] * len(batch)
            else:
                for entry in batch:
                    self._run([entry])
                return
        for entry, outcome in zip(batch, outcomes, strict=True):
            entry.outcome, entry.done = outcome, True

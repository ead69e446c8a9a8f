"""Group commit: callers on many threads hand their items to whichever of them writes next, so one
write (one transaction, one COPY per table, one commit) stores everything that arrived while the
previous write ran. Under load that is many reports per transaction; alone, a caller writes its own
item at once, with no wait and no extra thread.

At most one item per key goes into a write (a workload's reports are written one after another, in the
order they arrived). A write that fails as a whole is retried item by item, so one bad item fails only
its own caller.
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
    done: bool = False
    outcome: Any = None


class GroupCommit:
    def __init__(
        self,
        write: Callable[[list[Any]], Sequence[Any]],
        *,
        key: Callable[[Any], Hashable],
        most: int,
    ) -> None:
        """`write` stores a list of items and returns one outcome per item, in order; an outcome that
        is an exception is raised to that item's caller."""
        self._write, self._key, self._most = write, key, most
        self._queue: list[_Entry] = []
        self._queue_lock = threading.Lock()
        self._writing = threading.Lock()

    def submit(self, item: Any) -> Any:
        entry = _Entry(item, self._key(item))
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
        """The oldest entries, one per key, up to the limit; the rest wait for the next write."""
        with self._queue_lock:
            batch: list[_Entry] = []
            left: list[_Entry] = []
            keys: set[Hashable] = set()
            for entry in self._queue:
                if len(batch) < self._most and entry.key not in keys:
                    batch.append(entry)
                    keys.add(entry.key)
                else:
                    left.append(entry)
            self._queue = left
        return batch

    def _run(self, batch: list[_Entry]) -> None:
        try:
            outcomes = self._write([entry.item for entry in batch])
        except Exception as error:  # noqa: BLE001  (handed to the caller it belongs to)
            if len(batch) == 1:
                outcomes = [error]
            else:
                for entry in batch:
                    self._run([entry])
                return
        for entry, outcome in zip(batch, outcomes, strict=True):
            entry.outcome, entry.done = outcome, True

"""The time Python's cyclic garbage collector takes in this process, by generation.

A collection runs inside whatever allocation crossed its threshold, so a profile charges it to that
line (asyncio's call_soon, an SSL transport's constructor) and never names it. serve exposes these
sums as `palisade_gc_seconds_total` and the simulated fleet prints them in its summary. The callback
only adds to plain numbers: it runs wherever a collection starts, possibly with a lock held, so it
takes none.
"""

from __future__ import annotations

import gc
import time

GENERATIONS = (0, 1, 2)


class CollectorTime:
    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]  # by generation
        self.collections = [0, 0, 0]
        self._began = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        generation = info.get("generation", 0)
        self.seconds[generation] += time.perf_counter() - self._began
        self.collections[generation] += 1

    def install(self) -> CollectorTime:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self


collector_time = CollectorTime()

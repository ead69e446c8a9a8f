"""The cyclic collector's time, as serve exposes it (agent/collector_time.py, palisade_gc_seconds_total)."""

import gc

from agent.collector_time import CollectorTime, collector_time
from controlplane.metrics import COLLECTOR_TIME, REGISTRY


def exposed(generation: int) -> float:
    assert COLLECTOR_TIME in REGISTRY._collector_to_names  # registered: scraped with the rest
    (family,) = COLLECTOR_TIME.collect()
    (sample,) = [s for s in family.samples if s.labels == {"generation": str(generation)}]
    assert sample.name == "palisade_gc_seconds_total"
    return sample.value


def test_a_full_collection_is_timed_and_exposed_by_its_generation():
    collector_time.install()
    before, full = exposed(2), collector_time.collections[2]
    garbage = [[] for _ in range(50_000)]
    for item in garbage:
        item.append(item)  # cycles: only the collector frees them
    del garbage, item
    gc.collect()
    assert collector_time.collections[2] > full  # gc.collect(), and any the allocations set off
    assert exposed(2) > before


def test_each_generation_counts_apart_and_installing_twice_counts_once():
    timed = CollectorTime().install().install()
    try:
        gc.collect(0)
        gc.collect(1)
        assert timed.collections == [1, 1, 0]
        assert timed.seconds[0] > 0 and timed.seconds[1] > 0 and timed.seconds[2] == 0
    finally:
        gc.callbacks.remove(timed)

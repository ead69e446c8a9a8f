"""Group commit (flows/group_commit.py): reports that wait together are written together."""

from __future__ import annotations

import threading
import time

import pytest

from flows.group_commit import GroupCommit


class Recorder:
    """A write that records its batches; the first one waits until every caller has queued."""

    def __init__(self, callers: int = 0, bad: frozenset = frozenset()):
        self.batches: list[list] = []
        self.bad = bad
        self.all_queued = threading.Event()
        self.callers = callers
        self.lock = threading.Lock()

    def write(self, items: list) -> list:
        with self.lock:
            self.batches.append(list(items))
            first = len(self.batches) == 1
        if first and self.callers:
            self.all_queued.wait(5)
        if self.bad & {key for key, _ in items}:
            raise RuntimeError(f"cannot write {sorted(self.bad)}")
        return [
            ValueError(f"refused {value}") if value == "refuse" else f"stored {value}" for _, value in items
        ]


def submit_all(commit: GroupCommit, recorder: Recorder, items: list) -> list:
    """Submit every item on its own thread; the first write goes on once all the others are queued."""
    outcomes: list = [None] * len(items)

    def run(index, item):
        try:
            outcomes[index] = commit.submit(item)
        except Exception as error:  # noqa: BLE001  (compared below)
            outcomes[index] = error

    threads = [threading.Thread(target=run, args=(i, item)) for i, item in enumerate(items)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 5
    while not (recorder.batches and len(recorder.batches[0]) + len(commit._queue) == len(items)):
        assert time.monotonic() < deadline, "the callers did not queue"
        time.sleep(0.005)
    recorder.all_queued.set()
    for thread in threads:
        thread.join(10)
    return outcomes


def test_items_that_wait_together_are_written_together_and_each_caller_gets_its_own_outcome():
    recorder = Recorder(callers=8)
    commit = GroupCommit(recorder.write, key=lambda item: item[0], most=64)
    items = [(f"w{i}", i) for i in range(8)]
    outcomes = submit_all(commit, recorder, items)
    assert outcomes == [f"stored {i}" for i in range(8)]
    assert sum(len(batch) for batch in recorder.batches) == 8
    assert len(recorder.batches) < 8  # the callers that waited shared a write


def test_one_item_per_key_goes_into_a_write_in_the_order_they_arrived():
    recorder = Recorder(callers=6)
    commit = GroupCommit(recorder.write, key=lambda item: item[0], most=64)
    outcomes = submit_all(commit, recorder, [("a", 1), ("a", 2), ("b", 3), ("a", 4), ("b", 5), ("c", 6)])
    assert outcomes == [f"stored {i}" for i in range(1, 7)]
    for batch in recorder.batches:
        keys = [key for key, _ in batch]
        assert len(keys) == len(set(keys)), recorder.batches
    written_a = [value for batch in recorder.batches for key, value in batch if key == "a"]
    assert written_a == sorted(written_a)


def test_a_write_holds_at_most_the_limit():
    recorder = Recorder(callers=7)
    commit = GroupCommit(recorder.write, key=lambda item: item[0], most=3)
    submit_all(commit, recorder, [(f"w{i}", i) for i in range(7)])
    assert max(len(batch) for batch in recorder.batches) <= 3


def test_a_failed_write_is_retried_item_by_item_so_only_the_bad_item_fails():
    recorder = Recorder(callers=4, bad=frozenset({"poison"}))
    commit = GroupCommit(recorder.write, key=lambda item: item[0], most=64)
    outcomes = submit_all(commit, recorder, [("w1", 1), ("poison", 2), ("w3", 3), ("w4", 4)])
    assert outcomes[0] == "stored 1" and outcomes[2] == "stored 3" and outcomes[3] == "stored 4"
    assert isinstance(outcomes[1], RuntimeError)
    assert [("poison", 2)] in recorder.batches  # retried alone


def test_an_outcome_that_is_an_exception_is_raised_to_its_caller_alone():
    recorder = Recorder()
    commit = GroupCommit(recorder.write, key=lambda item: item[0], most=64)
    assert commit.submit(("w1", 1)) == "stored 1"
    with pytest.raises(ValueError, match="refused refuse"):
        commit.submit(("w2", "refuse"))
    assert recorder.batches == [[("w1", 1)], [("w2", "refuse")]]  # alone, a caller writes at once


def test_a_write_holds_items_up_to_the_weight_past_its_first_and_a_heavy_item_keeps_its_keys_order():
    recorder = Recorder(callers=6)
    commit = GroupCommit(
        recorder.write, key=lambda item: item[0], most=64, weight=lambda item: item[1], most_weight=10
    )
    items = [("a", 6), ("b", 3), ("c", 8), ("a", 1), ("d", 1), ("e", 12)]
    outcomes = submit_all(commit, recorder, items)
    assert outcomes == [f"stored {weight}" for _, weight in items]
    assert recorder.batches[0] == [("a", 6)]  # the first write began alone, before the others queued
    for batch in recorder.batches[1:]:
        assert len(batch) == 1 or sum(weight for _, weight in batch) <= 10, recorder.batches
    assert [("e", 12)] in recorder.batches  # heavier than the bound: written alone
    written_a = [weight for batch in recorder.batches for key, weight in batch if key == "a"]
    assert written_a == [6, 1]


class Busy(Exception):
    pass


def test_a_failure_that_is_no_items_fault_fails_every_item_of_the_write_without_retrying_each():
    recorder = Recorder(callers=4, bad=frozenset({"w1", "w2", "w3", "w4"}))

    def busy_write(items):
        try:
            return recorder.write(items)
        except RuntimeError as error:
            raise Busy(str(error)) from None

    commit = GroupCommit(
        busy_write, key=lambda item: item[0], most=64, shared_failure=lambda error: isinstance(error, Busy)
    )
    outcomes = submit_all(commit, recorder, [("w1", 1), ("w2", 2), ("w3", 3), ("w4", 4)])
    assert all(isinstance(outcome, Busy) for outcome in outcomes), outcomes
    assert sum(len(batch) for batch in recorder.batches) == 4  # each item written once: none retried alone

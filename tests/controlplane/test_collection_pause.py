"""The collector held off around heavy reads (controlplane/collection_pause.py)."""

from __future__ import annotations

import gc
import threading
from types import SimpleNamespace

import pytest

from controlplane.collection_pause import collection_paused, without_collection


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_held_off_inside_and_on_again_after_the_last_hold():
    with collection_paused():
        assert not gc.isenabled()
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer hold still runs
    assert gc.isenabled()


def test_on_again_after_an_exception():
    @without_collection
    def fails():
        assert not gc.isenabled()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        fails()
    assert gc.isenabled()


def test_left_off_when_it_was_off_before():
    gc.disable()
    with collection_paused():
        pass
    assert not gc.isenabled()


def test_threads_holding_at_once_keep_it_off_until_the_last_ends():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def first():
        with collection_paused():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with collection_paused():
            second_in.set()
            first_out.wait(5)
            seen.append(gc.isenabled())  # the first ended: still held by this one

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == [False]
    assert gc.isenabled()


class _Seen(Exception):
    pass


def test_the_fleet_reads_run_with_it_held(monkeypatch):
    """A fleet's suggestions and a draft's impact build their answers with the collector off (the
    first step each takes is replaced by one that says whether it is on, then stops the read)."""
    from flows.policy_drafts import impact, suggestions

    seen = []

    def step(*args, **kwargs):
        seen.append(gc.isenabled())
        raise _Seen

    monkeypatch.setattr(suggestions, "flow_range_plan", step)
    monkeypatch.setattr(impact, "workloads_selected", step)
    with pytest.raises(_Seen):
        suggestions.policy_suggest(selected=None, start=None, end=None, label_keys=["app"])
    with pytest.raises(_Seen):
        impact.draft_impact(draft=None, selection=SimpleNamespace(workload_ids=[], labels=[]))
    assert seen == [False, False]
    assert gc.isenabled()

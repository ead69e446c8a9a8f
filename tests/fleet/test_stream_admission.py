"""The bound on stream authentications in progress, and the waits it tells the refused (fleet/admission.py)."""

from __future__ import annotations

from fleet.admission import MAX_WAIT_SECONDS, StreamAdmission


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_under_the_bound_every_stream_is_admitted_and_leaving_makes_room():
    admission = StreamAdmission(limit=3, clock=Clock())
    assert [admission.enter() for _ in range(3)] == [None, None, None]
    assert admission.enter() is not None
    admission.leave(completed=True)
    assert admission.enter() is None
    assert admission.in_progress == 3
    assert admission.refused == 1


def test_the_refused_are_spaced_at_the_rate_authentications_complete():
    clock = Clock()
    admission = StreamAdmission(limit=10, clock=clock)
    for _ in range(10):
        assert admission.enter() is None
    # 100 completed within the last ten seconds: 10 a second, the bound refilled each time.
    for i in range(100):
        clock.now = 1000.0 + i * 0.1
        admission.leave(completed=True)
        assert admission.enter() is None
    waits = [admission.enter() for _ in range(300)]
    assert all(w is not None for w in waits)
    # 300 refused at 10 a second: their returns spread over 30 s, about ten for each second.
    assert min(waits) == 1
    assert 29 <= max(waits) <= 31
    per_second = [waits.count(s) for s in range(1, 31)]
    assert max(per_second) <= 11


def test_without_completions_the_bound_every_two_seconds_is_assumed_and_the_wait_is_capped():
    admission = StreamAdmission(limit=2, clock=Clock())
    admission.enter(), admission.enter()
    waits = [admission.enter() for _ in range(5000)]
    assert waits[:3] == [1, 2, 3]  # one a second: 2 per 2 s
    assert max(waits) == MAX_WAIT_SECONDS


def test_the_schedule_empties_as_time_passes():
    clock = Clock()
    admission = StreamAdmission(limit=1, clock=clock)
    admission.enter()
    assert [admission.enter() for _ in range(4)] == [1, 3, 5, 7]
    clock.now += 60
    assert admission.enter() == 1


def test_no_bound_when_the_limit_is_zero():
    admission = StreamAdmission(limit=0, clock=Clock())
    assert all(admission.enter() is None for _ in range(1000))

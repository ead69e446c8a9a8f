"""The bound on stream authentications in progress, and the waits it tells the refused (fleet/admission.py)."""

from __future__ import annotations

from fleet.admission import ASSUMED_DURATION_SECONDS, MAX_WAIT_SECONDS, StreamAdmission


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_under_the_bound_every_stream_is_admitted_and_leaving_makes_room():
    clock = Clock()
    admission = StreamAdmission(limit=3, clock=clock)
    assert [admission.enter() for _ in range(3)] == [None, None, None]
    assert admission.enter() is not None
    admission.leave(began=clock.now, completed=True)
    assert admission.enter() is None
    assert admission.in_progress == 3
    assert admission.refused == 1


def test_the_refused_are_spaced_at_the_rate_authentications_complete():
    clock = Clock()
    admission = StreamAdmission(limit=10, clock=clock)
    # Authentications of one second each, ten at a time: ten complete a second.
    for _ in range(200):
        clock.now += 0.1
        assert admission.enter() is None
        admission.leave(began=clock.now - 1.0, completed=True)
    for _ in range(10):
        admission.enter()
    waits = [admission.enter() for _ in range(300)]
    assert all(w is not None for w in waits)
    # 300 refused at 10 a second: their returns spread over 30 s, about ten for each second.
    assert min(waits) == 1
    assert 29 <= max(waits) <= 31
    assert max(waits.count(s) for s in range(1, 31)) <= 11


def test_the_rate_follows_the_durations_at_once_without_waiting_for_completions_to_add_up():
    # Right after a failover: nothing completed lately, but the first few took 0.1 s each, so a bound
    # of 10 clears 100 a second, and 1,000 refused are told to come back within about 10 s.
    clock = Clock()
    admission = StreamAdmission(limit=10, clock=clock)
    for _ in range(100):
        admission.enter()
        admission.leave(began=clock.now - 0.1, completed=True)
    for _ in range(10):
        admission.enter()
    waits = [admission.enter() for _ in range(1000)]
    assert max(waits) <= 12


def test_before_any_completion_a_duration_is_assumed_and_the_wait_is_capped():
    admission = StreamAdmission(limit=2, clock=Clock())
    admission.enter(), admission.enter()
    waits = [admission.enter() for _ in range(5000)]
    per_second = 2 / ASSUMED_DURATION_SECONDS  # the first at 1 s, then one every 1 / per_second
    assert waits.count(2) == per_second
    assert max(waits) == MAX_WAIT_SECONDS


def test_the_schedule_empties_as_time_passes():
    clock = Clock()
    admission = StreamAdmission(limit=1, clock=clock)
    for _ in range(50):  # authentications of two seconds: one every two seconds
        clock.now += 2.0
        admission.enter()
        admission.leave(began=clock.now - 2.0, completed=True)
    admission.enter()
    assert [admission.enter() for _ in range(4)] == [1, 3, 5, 7]
    clock.now += 60
    assert admission.enter() == 1


def test_no_bound_when_the_limit_is_zero():
    admission = StreamAdmission(limit=0, clock=Clock())
    assert all(admission.enter() is None for _ in range(1000))

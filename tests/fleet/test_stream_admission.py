"""The bound on stream authentications in progress, and the waits it tells the refused (fleet/admission.py)."""

from __future__ import annotations

from fleet.admission import ASSUMED_DURATION_SECONDS, HOLD_SECONDS, MAX_WAIT_SECONDS, StreamAdmission


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def authenticated(admission: StreamAdmission, clock: Clock, seconds: float) -> None:
    """An authentication of `seconds` that completes now."""
    holder = object()
    clock.now -= seconds
    assert admission.enter(holder) is None
    clock.now += seconds
    admission.leave(holder, completed=True)


def entered(admission: StreamAdmission, count: int = 1) -> list:
    return [admission.enter(object()) for _ in range(count)]


def test_under_the_bound_every_stream_is_admitted_and_leaving_makes_room():
    clock = Clock()
    admission = StreamAdmission(limit=3, clock=clock)
    first, *others = [object() for _ in range(3)]
    assert [admission.enter(h) for h in (first, *others)] == [None, None, None]
    assert entered(admission) != [None]
    admission.leave(first, completed=True)
    admission.leave(first, completed=False)  # once only: a second leave frees nothing
    assert entered(admission) == [None]
    assert admission.in_progress == 3
    assert entered(admission) != [None]
    assert admission.refused == 2


def test_a_place_held_past_the_hold_time_is_released_for_the_next():
    # A stream that ended without leaving: its place comes back after HOLD_SECONDS instead of
    # shrinking the bound for good (a process was seen refusing everyone with every place so held).
    clock = Clock()
    admission = StreamAdmission(limit=2, clock=clock)
    lost, slow = object(), object()
    admission.enter(lost)
    clock.now += HOLD_SECONDS / 2
    admission.enter(slow)
    assert entered(admission) != [None]
    clock.now += HOLD_SECONDS / 2 + 1
    assert entered(admission) == [None]  # the lost one's place
    assert admission.in_progress == 2 and admission.released_stale == 1
    assert entered(admission) != [None]  # the slow one is still within its time
    admission.leave(lost, completed=True)  # late: frees nothing, and no duration counted
    assert admission.in_progress == 2 and admission.duration == ASSUMED_DURATION_SECONDS


def test_the_refused_are_spaced_at_the_rate_authentications_complete():
    clock = Clock()
    admission = StreamAdmission(limit=10, clock=clock)
    # Authentications of one second each, ten at a time: ten complete a second.
    for _ in range(200):
        clock.now += 0.1
        authenticated(admission, clock, 1.0)
    entered(admission, 10)
    waits = entered(admission, 300)
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
        authenticated(admission, clock, 0.1)
    entered(admission, 10)
    waits = entered(admission, 1000)
    assert max(waits) <= 12


def test_before_any_completion_a_duration_is_assumed_and_the_wait_is_capped():
    admission = StreamAdmission(limit=2, clock=Clock())
    entered(admission, 2)
    waits = entered(admission, 5000)
    per_second = 2 / ASSUMED_DURATION_SECONDS  # the first at 1 s, then one every 1 / per_second
    assert waits.count(2) == per_second
    assert max(waits) == MAX_WAIT_SECONDS


def test_the_schedule_empties_as_time_passes():
    clock = Clock()
    admission = StreamAdmission(limit=1, clock=clock)
    for _ in range(50):  # authentications of two seconds: one every two seconds
        clock.now += 2.0
        authenticated(admission, clock, 2.0)
    entered(admission)
    assert entered(admission, 4) == [1, 3, 5, 7]
    clock.now += 20
    assert entered(admission) == [1]


def test_no_bound_when_the_limit_is_zero():
    admission = StreamAdmission(limit=0, clock=Clock())
    assert entered(admission, 1000) == [None] * 1000

"""The spec's "Limits" and its rules for `agent_silent`, case by case (fleet/health.py).

Each row is a case in the spec's words; its id is what the test run prints. Instants are minutes and
seconds after T, a whole minute; windows are one minute (the default) unless a row says otherwise.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from fleet import health

T = datetime(2026, 3, 2, 10, 0, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


def at(minutes: float = 0, seconds: float = 0) -> datetime:
    return T + timedelta(minutes=minutes, seconds=seconds)


def s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


# --- Limits: telemetry counted as live, a flow report within two flow windows of the read ---


@pytest.mark.parametrize(
    ("last_report", "window", "live"),
    [
        pytest.param(at(seconds=-119), MINUTE, True, id="a report 119 s ago with 60 s windows: live"),
        pytest.param(at(seconds=-120), MINUTE, True, id="a report exactly two windows ago: live"),
        pytest.param(at(seconds=-121), MINUTE, False, id="121 s ago: not live"),
        pytest.param(at(seconds=-5), s(1), False, id="5 s ago with one-second windows: not live"),
        pytest.param(at(minutes=-90), timedelta(hours=1), True, id="90 min ago with hour windows: live"),
        pytest.param(None, MINUTE, False, id="no report ever: not live"),
    ],
)
def test_telemetry_live(last_report, window, live):
    assert health.telemetry_live(last_report_at=last_report, window=window, now=T) is live


# --- Limits: clock skew, the agent's clock off by more than two flow windows ---


@pytest.mark.parametrize(
    ("agent_clock", "window", "skewed"),
    [
        pytest.param(at(), MINUTE, False, id="clocks agree: no skew"),
        pytest.param(at(seconds=120), MINUTE, False, id="clock ahead by exactly two windows: no skew"),
        pytest.param(at(seconds=-120), MINUTE, False, id="clock behind by exactly two windows: no skew"),
        pytest.param(at(seconds=120.001), MINUTE, True, id="ahead by a millisecond over two windows: skew"),
        pytest.param(at(seconds=-300), MINUTE, True, id="five minutes behind: skew"),
        pytest.param(
            at(seconds=-300), timedelta(hours=1), False, id="five minutes behind, hour windows: no skew"
        ),
        pytest.param(at(seconds=3), s(1), True, id="three seconds ahead, one-second windows: skew"),
    ],
)
def test_clock_skew(agent_clock, window, skewed):
    assert health.clock_skewed(agent_clock=agent_clock, now=T, window=window) is skewed


# --- Process liveness: a report newer than the latest moves liveness; a replay moves nothing ---


@pytest.mark.parametrize(
    ("process", "uptime", "news"),
    [
        pytest.param("p2", 700, True, id="the same process, longer up: news"),
        pytest.param("p2", 600, False, id="the same process, as long up (a verbatim replay): not news"),
        pytest.param("p2", 300, False, id="the same process, less up (an older report re-sent): not news"),
        pytest.param("p3", 5, True, id="a process never seen (a restart): news"),
        pytest.param("p1", 9000, False, id="a process that reported before the latest one: not news"),
    ],
)
def test_a_report_newer_than_the_latest(process, uptime, news):
    latest = {"latest_process": "p2", "latest_uptime": 600.0, "earlier": ["p1", "p0"]}
    assert health.report_is_news(process=process, uptime=uptime, **latest) is news


def test_the_first_report_of_a_workload_is_news():
    assert health.report_is_news(process="p1", uptime=1, latest_process="", latest_uptime=None, earlier=[""])


@pytest.mark.parametrize(
    ("process", "latest", "earlier", "after"),
    [
        pytest.param("p2", "p2", ["p1"], ["p1"], id="the same process: the earlier ones stay"),
        pytest.param("p3", "p2", ["p1"], ["p2", "p1"], id="a restart: the old process is the newest earlier"),
        pytest.param("p1", "", [], [], id="the first process: none earlier"),
        pytest.param(
            "p9", "p8", [f"p{i}" for i in range(7, -1, -1)], [f"p{i}" for i in range(8, 0, -1)],
            id="a restart with eight earlier: the oldest is forgotten",
        ),
    ],
)  # fmt: skip
def test_the_processes_before_a_report(process, latest, earlier, after):
    assert health.processes_before(process=process, latest_process=latest, earlier=earlier) == after


@pytest.mark.parametrize(
    ("process", "heard_at", "known_alive_at", "alive_at"),
    [
        pytest.param("p1", at(5), at(2), at(5), id="a heartbeat of the reporting process: alive until then"),
        pytest.param("p2", at(5), at(2), None, id="a heartbeat of another process: says nothing of it"),
        pytest.param(None, at(5), at(2), None, id="a heartbeat naming no process: says nothing"),
        pytest.param("p1", at(1), at(2), None, id="a heartbeat older than what is known: moves nothing"),
        pytest.param("p1", at(2), at(2), None, id="a heartbeat at the instant known: moves nothing"),
        pytest.param("p1", at(5), None, at(5), id="the first sign of life of the reporting process"),
    ],
)
def test_a_heartbeat_shows_the_process_running(process, heard_at, known_alive_at, alive_at):
    seen = health.process_seen(process=process, at=heard_at, reporting_process="p1", alive_at=known_alive_at)
    assert seen == alive_at


# --- Silent since: a workload's last sign of life, and silence past two windows ---


@pytest.mark.parametrize(
    ("last_report", "alive", "since"),
    [
        pytest.param(at(0), None, at(0), id="no heartbeat: silent since the last report"),
        pytest.param(at(0), at(4), at(4), id="heartbeats after the last report: silent since the last one"),
        pytest.param(at(4), at(0), at(4), id="a report after the last heartbeat: silent since the report"),
    ],
)
def test_silent_since(last_report, alive, since):
    assert health.silent_since(last_report_at=last_report, alive_at=alive) == since


@pytest.mark.parametrize(
    ("until", "window", "silent"),
    [
        pytest.param(at(seconds=119), MINUTE, False, id="quiet for 119 s with 60 s windows: not silent"),
        pytest.param(at(seconds=120), MINUTE, False, id="quiet for exactly two windows: not silent"),
        pytest.param(at(seconds=121), MINUTE, True, id="quiet for 121 s: silent"),
        pytest.param(at(minutes=100), timedelta(hours=1), False, id="100 min with hour windows: not silent"),
    ],
)
def test_gone_silent(until, window, silent):
    assert health.gone_silent(since=T, window=window, until=until) is silent


# --- agent_silent ---


@pytest.mark.parametrize(
    ("instant", "window", "opened"),
    [
        pytest.param(at(3, 42.5), MINUTE, at(3), id="at 10:03:42.5, one-minute windows: the window of 10:03"),
        pytest.param(at(3), MINUTE, at(3), id="at a window's first instant: that window"),
        pytest.param(at(17), s(600), at(10), id="at 10:17, ten-minute windows: the window of 10:10"),
    ],
)
def test_the_window_open_at_an_instant(instant, window, opened):
    assert health.window_open_at(instant, window) == opened


LAST_ALIVE = at(0, 30)  # the old process's last report, in the window of 10:00


def silences(*, previous="p1", alive_at=LAST_ALIVE, process="p2", started, window=MINUTE, covered=()):
    """The agent_silent gaps before a report of `process` that started at `started`, with the latest
    report's process `previous` last known alive at `alive_at`, and these windows stored or arriving."""
    return health.agent_silent(
        latest_process=previous,
        alive_at=alive_at,
        latest_window=window,
        process=process,
        started=started,
        window=window,
        covered=lambda start, end: list(covered),
    )


@pytest.mark.parametrize(
    ("case", "gaps"),
    [
        pytest.param(
            {"process": "p1", "started": at(-60)}, [],
            id="a quiet workload whose heartbeats show the same process: no gap",
        ),
        pytest.param(
            {"started": at(2, 30)}, [],
            id="a quick restart, two windows after the old process was last alive: no gap",
        ),
        pytest.param(
            {"started": at(10, 30)}, [(at(0), at(10, 30))],
            id="a restart after a silence: gap from the start of the old process's open window to the new start",
        ),
        pytest.param(
            {"alive_at": at(8, 10), "started": at(10, 0)}, [],
            id="heartbeats of the old process until shortly before the restart: no gap",
        ),
        pytest.param(
            {"alive_at": at(8, 10), "started": at(20, 0)}, [(at(8), at(20))],
            id="heartbeats of the old process, then a silence: gap from its window open at the last heartbeat",
        ),
        pytest.param(
            {"started": at(10), "covered": [(at(0), at(9))]}, [],
            id="windows buffered through the outage cover it: no gap",
        ),
        pytest.param(
            {"started": at(20), "covered": [(at(0), at(15))]}, [(at(15), at(20))],
            id="windows buffered through part of the outage: gap after the last of them",
        ),
        pytest.param(
            {"started": at(20), "covered": [(at(0), at(18, 30))]}, [],
            id="what the buffered windows leave uncovered is under two windows: no gap",
        ),
        pytest.param(
            {"started": at(30), "covered": [(at(10), at(11))]}, [(at(0), at(10)), (at(11), at(30))],
            id="a window in the middle of the silence: a gap either side of it",
        ),
        pytest.param(
            {"previous": "", "alive_at": None, "started": at(30)}, [],
            id="the first report of a workload: nothing to be silent since",
        ),
        pytest.param(
            {"started": at(10, 30), "window": s(600)}, [],
            id="ten minutes of silence with ten-minute windows: under two windows, no gap",
        ),
    ],
)  # fmt: skip
def test_agent_silent(case, gaps):
    assert silences(**case) == gaps


def test_the_silence_starts_in_the_old_process_s_window_not_the_new_one_s():
    """The window the old process had open is of its own length, which the latest report stated."""
    gaps = health.agent_silent(
        latest_process="p1",
        alive_at=at(17),
        latest_window=s(600),
        process="p2",
        started=at(40),
        window=MINUTE,
        covered=lambda start, end: [],
    )
    assert gaps == [(at(10), at(40))]


@pytest.mark.parametrize(
    ("process", "started", "asked"),
    [
        pytest.param("p2", at(10, 30), [(at(0), at(10, 30))], id="a restart after a silence: its windows"),
        pytest.param("p2", at(2), [], id="a restart under two windows: none"),
        pytest.param("p1", at(10, 30), [], id="the same process: none"),
    ],
)
def test_the_stored_windows_read_are_those_of_the_silence(process, started, asked):
    """Reading the stored windows is a query, made only for a silence past the threshold."""
    reads = []
    health.agent_silent(
        latest_process="p1",
        alive_at=at(0, 30),
        latest_window=MINUTE,
        process=process,
        started=started,
        window=MINUTE,
        covered=lambda start, end: reads.append((start, end)) or [],
    )
    assert reads == asked


@pytest.mark.parametrize(
    ("covered", "parts"),
    [
        pytest.param([], [(at(0), at(10))], id="nothing covered: all of it"),
        pytest.param([(at(-5), at(15))], [], id="one window over all of it: nothing"),
        pytest.param([(at(2), at(3)), (at(5), at(6))], [(at(0), at(2)), (at(3), at(5)), (at(6), at(10))],
                     id="two windows inside: the three parts around them"),
        pytest.param([(at(5), at(6)), (at(2), at(3))], [(at(0), at(2)), (at(3), at(5)), (at(6), at(10))],
                     id="in any order"),
        pytest.param([(at(0), at(4)), (at(3), at(7))], [(at(7), at(10))], id="overlapping windows: one cover"),
    ],
)  # fmt: skip
def test_the_uncovered_parts_of_a_silence(covered, parts):
    assert health.uncovered(at(0), at(10), covered) == parts

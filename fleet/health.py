"""Flow health: the spec's "Limits" and its rules for `agent_silent`, in one place.

Pure: functions of instants, durations and agent process ids (no Django, no database), so that each
rule reads as the spec states it and tests/fleet/test_health.py checks it case by case. The callers
read and write the workload's fields: `fleet/representations.py` (telemetry live), `fleet/sync.py`
(heartbeats keep a process alive), `flows/services.py` (a report: news or replay, clock skew,
agent_silent) and `flows/selectors.py` (the coverage's silent workloads).

Every threshold is two flow windows, and a window is the workload's own (its agent's latest report
says how long), so the same rule holds for agents of one-second and one-hour windows alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

LIMIT_WINDOWS = 2  # "two flow windows": telemetry live, clock skew and agent_silent alike
EARLIER_PROCESSES_KEPT = 8  # processes remembered before the latest one, to know a late replay of theirs

Interval = tuple[datetime, datetime]


def limit(window: timedelta) -> timedelta:
    """Two flow windows: two minutes for the default one-minute windows."""
    return LIMIT_WINDOWS * window


def telemetry_live_since(*, window: timedelta, now: datetime) -> datetime:
    """The earliest flow report that keeps telemetry live at `now`: two flow windows before it (the
    fleet's counts select on it in SQL, controlplane/metrics_collector.py)."""
    return now - limit(window)


def telemetry_live(*, last_report_at: datetime | None, window: timedelta, now: datetime) -> bool:
    """Telemetry counted as live: a flow report arrived within two flow windows of the read."""
    return last_report_at is not None and last_report_at >= telemetry_live_since(window=window, now=now)


def clock_skewed(*, agent_clock: datetime, now: datetime, window: timedelta) -> bool:
    """Clock skew: the agent's clock off from the control plane's by more than two flow windows, either
    way (a report within the threshold clears a skew shown before)."""
    return abs((agent_clock - now).total_seconds()) > limit(window).total_seconds()


# --- process liveness: which agent process is running, and until when it is known to have run ---


def report_is_news(
    *, process: str, uptime: float, latest_process: str, latest_uptime: float | None, earlier: Iterable[str]
) -> bool:
    """A report newer than the latest one: from the latest report's process with a greater uptime, or
    from a process not seen before (a restart). A report with no greater uptime (a verbatim replay, a
    re-send) or from a process that reported before the latest one says nothing of the agent now: it
    is stored all the same (its ids make that idempotent), but it moves neither liveness nor the clock
    skew; taken as news, a replay minutes later would revive telemetry and set a false skew."""
    if process == latest_process:
        return latest_uptime is None or uptime > latest_uptime
    return process not in earlier


def processes_before(*, process: str, latest_process: str, earlier: list[str]) -> list[str]:
    """The processes that reported before `process` (newest first, at most EARLIER_PROCESSES_KEPT):
    after a restart the latest report's process joins them."""
    if process == latest_process or not latest_process:
        return earlier
    return [latest_process, *earlier][:EARLIER_PROCESSES_KEPT]


def process_seen(
    *, process: str | None, at: datetime, reporting_process: str, alive_at: datetime | None
) -> datetime | None:
    """A sign of life (a heartbeat, a stream's end) of `process` at `at`: if it is the process that
    sent the latest flow report, that process ran until then (a quiet workload, not a silent one), and
    this returns the new instant it is known alive at; None when it moves nothing (another process,
    or no later than already known)."""
    if not process or process != reporting_process:
        return None
    if alive_at is not None and at <= alive_at:
        return None
    return at


# --- silence ---


def silent_since(*, last_report_at: datetime, alive_at: datetime | None) -> datetime:
    """When a workload's silence began, as the coverage shows it: its last sign of life, the latest of
    its last flow report and the last heartbeat of the process that sent it."""
    return max(last_report_at, alive_at) if alive_at is not None else last_report_at


def gone_silent(*, since: datetime, window: timedelta, until: datetime) -> bool:
    """Silent by `until`: no report and no heartbeat of the reporting process for more than two flow
    windows (the `agent_silent` threshold)."""
    return since + limit(window) < until


def window_open_at(instant: datetime, window: timedelta) -> datetime:
    """The start of the agent's window that holds `instant`: windows are aligned to the wall clock,
    [k * length, (k + 1) * length) from the epoch (agent/flowwindow.py)."""
    return instant - timedelta(seconds=instant.timestamp() % window.total_seconds())


def uncovered(start: datetime, end: datetime, covered: Iterable[Interval]) -> list[Interval]:
    """The parts of [start, end) that no range of `covered` overlaps."""
    parts, cursor = [], start
    for low, high in sorted(covered):
        if high <= cursor:
            continue
        if low > cursor:
            parts.append((cursor, min(low, end)))
        cursor = max(cursor, high)
        if cursor >= end:
            break
    if cursor < end:
        parts.append((cursor, end))
    return [(low, high) for low, high in parts if low < high]


def agent_silent(
    *,
    latest_process: str,
    alive_at: datetime | None,
    latest_window: timedelta,
    process: str,
    started: datetime,
    window: timedelta,
    covered: Callable[[datetime, datetime], Iterable[Interval]],
) -> list[Interval]:
    """The spec's agent_silent, as the control plane derives it when the agent reports again (rules 1
    and 2): the silent intervals before a report of `process`, which started at `started` (the report's
    instant minus its uptime) and reports windows of `window`.

    A report from the process that sent the latest one (`latest_process`, last known alive at
    `alive_at`: its last report or heartbeat) means that process ran throughout: a quiet workload, no
    gap (rule 4). From another process (a restart), the time between the old process last known alive
    and the new one's start is silent where no window covers it (`covered(start, end)`: the windows
    stored or arriving there; windows the agent buffered through an outage cover the time they were
    held back, rule 3), if that part is longer than two windows.

    The silence is taken from the start of the window the old process had open when last known alive
    (windows of `latest_window`): that window was in its memory, not yet in its buffer, so a process
    that died (killed, crashed) lost what it had counted in it. A process that stopped cleanly closed it
    and its successor sends it, which then covers that part."""
    if not latest_process or latest_process == process or alive_at is None:
        return []
    threshold = limit(window)
    if started - alive_at <= threshold:
        return []
    since = window_open_at(alive_at, latest_window)
    return [
        (low, high)
        for low, high in uncovered(since, started, covered(since, started))
        if high - low > threshold
    ]

"""The agent's figures for node_exporter's textfile collector (`run --metrics-textfile PATH`): the agent
listens on no port; node_exporter reads the file and serves it with the host's other metrics.

The exposition is prometheus_client's (`generate_latest` over a collector that reads the daemon's own
state at each write, so no figure can drift from what the daemon holds). The file is written aside,
in the same directory under a name node_exporter ignores (`.NAME.PID.RANDOM.tmp`, not `*.prom`),
synced and renamed over PATH, so a reader sees the previous file or the next one, never part of one.
prometheus_client's own `write_to_textfile` renames too, but neither syncs the data before the rename
(a crash can leave an empty file under the real name) nor sets a mode: under the unit's `UMask=0077`
the file would be unreadable by node_exporter's user; so the agent's `write_atomically` (state.py)
writes it, mode 0644.

Written every `interval` seconds (15 by default), and on important changes (the stream, the applied
version, an apply failure, the owned table, the credential, a flow source going down or up or
overrunning) no sooner than `SOONEST_SECONDS` after the previous write, so a burst makes one write.
At a clean exit the file is written a last time with `palisade_agent_running 0` and the stream
disconnected, and left in place: the table stays in the kernel when the agent stops (fail static), so
the applied version and the table's state are still true, and node_exporter's
`node_textfile_mtime_seconds` says when the agent stopped. After a crash the file keeps
`palisade_agent_running 1` and grows old: alert on its mtime.

A failed write is logged once per condition (`metrics write failed`, then `metrics write recovered`)
and never stops the agent. The names, types and meanings are in docs/metrics.md.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent import __version__
from agent.credential import CredentialError, parse_instant
from agent.protocol import OWNED_TABLE_STATES
from agent.state import write_atomically

if TYPE_CHECKING:
    from datetime import datetime

    from agent.flowreporter import FlowReporter
    from agent.state import Identity
    from agent.status import DaemonStatus


class Agent(Protocol):
    """What the textfile reads of the daemon (agent/daemon.py `Agent`, which writes through this module:
    the figures know the daemon by these fields alone)."""

    status: DaemonStatus
    identity: Identity | None
    apply_failures: int
    denied_connections_ended: int
    owned_table: str
    table_modifications: int
    expires_at: str | datetime | None
    renewal_due_at: str | datetime | None
    flows: FlowReporter | None


DEFAULT_INTERVAL_SECONDS = 15.0
SOONEST_SECONDS = 1.0
FILE_MODE = 0o644  # node_exporter runs as its own user
LABEL_MAX_CHARS = 128  # a version is a hash; a longer one from a faulty gateway is cut, not copied


def _timestamp(value: str | datetime | None) -> float | None:
    if value is None:
        return None
    try:
        return (parse_instant(value) if isinstance(value, str) else value).timestamp()
    except CredentialError:
        return None


def _gauge(name: str, documentation: str, value: float | None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    if value is not None:
        family.add_metric([], value)
    return family


def agent_families(agent: Agent, *, running: bool) -> list[Metric]:
    """The daemon's own figures: the process, the applied version, the table, the stream, the
    credential."""
    status = agent.status.data
    info = GaugeMetricFamily(
        "palisade_agent_info",
        "This agent: its version and workload.",
        labels=["agent_version", "workload_id"],
    )
    info.add_metric([__version__, agent.identity.workload_id if agent.identity else ""], 1)
    applied = status.get("applied") or None
    applied_info = GaugeMetricFamily(
        "palisade_agent_applied_version_info",
        "The policy version applied as the owned table (1; no sample before the first apply).",
        labels=["version", "mode"],
    )
    if applied:
        applied_info.add_metric(
            [str(applied.get("version"))[:LABEL_MAX_CHARS], str(applied.get("mode"))[:LABEL_MAX_CHARS]], 1
        )
    failures = CounterMetricFamily(
        "palisade_agent_apply_failures",
        "Snapshots libnftables refused since the agent started (the previous table stayed).",
    )
    failures.add_metric([], agent.apply_failures)
    ended = CounterMetricFamily(
        "palisade_agent_denied_connections_ended",
        "Open inbound connections ended (their conntrack entries removed) because an enforced table's "
        "deny rule refuses them, since the agent started.",
    )
    ended.add_metric([], agent.denied_connections_ended)
    table = GaugeMetricFamily(
        "palisade_agent_owned_table",
        "The owned table's state: 1 for the current one of present, absent, unknown.",
        labels=["state"],
    )
    for state in OWNED_TABLE_STATES:
        table.add_metric([state], 1 if agent.owned_table == state else 0)
    modifications = CounterMetricFamily(
        "palisade_agent_owned_table_modifications",
        "Hand edits of the owned table by another process that the agent put right, since it started.",
    )
    modifications.add_metric([], agent.table_modifications)
    modified = status.get("table_modified") or {}
    connected = running and agent.status.stream_state == "connected"
    return [
        info,
        _gauge("palisade_agent_running", "1 while the daemon runs; 0 in the file it leaves at a clean exit.",
               1 if running else 0),
        _gauge("palisade_agent_start_time_seconds", "When the daemon started (Unix time).",
               _timestamp(status.get("started_at"))),
        applied_info,
        _gauge("palisade_agent_applied_timestamp_seconds", "When the applied version was applied (Unix time).",
               _timestamp(applied.get("at")) if applied else None),
        failures,
        ended,
        table,
        modifications,
        _gauge("palisade_agent_owned_table_modified_timestamp_seconds",
               "When the agent last saw another process edit the owned table (Unix time).",
               _timestamp(modified.get("modified_at"))),
        _gauge("palisade_agent_stream_connected", "1 while the sync stream to the gateway is connected.",
               1 if connected else 0),
        _gauge("palisade_agent_credential_expiry_timestamp_seconds",
               "When the agent's credential expires (Unix time, the control plane's clock).",
               _timestamp(agent.expires_at)),
        _gauge("palisade_agent_credential_renewal_due_timestamp_seconds",
               "When the agent asks for a new credential (Unix time, the control plane's clock).",
               _timestamp(agent.renewal_due_at)),
    ]  # fmt: skip


def flow_families(flows: FlowReporter, *, now: float) -> list[Metric]:
    """The flow evidence loop's figures: each source's health, the buffer, the delivery lag."""
    up = GaugeMetricFamily(
        "palisade_agent_flow_source_up", "1 while the flow source is subscribed.", labels=["source"]
    )
    events = CounterMetricFamily(
        "palisade_agent_flow_source_events",
        "Events the flow source read: connection events of marked connections (conntrack), "
        "logged dropped packets (nflog).",
        labels=["source"],
    )
    overruns = CounterMetricFamily(
        "palisade_agent_flow_source_overruns",
        "Times the flow source's socket buffer overran and events were lost (each a source_overrun gap).",
        labels=["source"],
    )
    restarts = CounterMetricFamily(
        "palisade_agent_flow_source_restarts",
        "Times the flow source went down and the agent began restarting it.",
        labels=["source"],
    )
    for thread in flows.threads:
        up.add_metric([thread.name], 1 if thread.subscribed else 0)
        events.add_metric([thread.name], thread.events_read())
        overruns.add_metric([thread.name], thread.overruns())
        restarts.add_metric([thread.name], thread.restarts)
    windows, gaps = flows.buffer.pending()
    ends = [record["end"] for record in (*windows, *gaps)]
    return [
        up,
        events,
        overruns,
        restarts,
        _gauge("palisade_agent_flow_buffer_windows",
               "Closed windows waiting in the buffer for the control plane's acknowledgement.", len(windows)),
        _gauge("palisade_agent_flow_buffer_capacity_windows",
               "Windows the buffer holds at most (--flow-buffer-records); beyond, the oldest are dropped.",
               flows.buffer.max_records),
        _gauge("palisade_agent_flow_buffer_gaps", "Gaps waiting in the buffer for acknowledgement.", len(gaps)),
        _gauge("palisade_agent_flow_oldest_unacknowledged_age_seconds",
               "Seconds since the oldest window or gap not yet acknowledged ended; 0 when none waits.",
               max(0.0, now - min(ends)) if ends else 0.0),
    ]  # fmt: skip


class _Families:
    """A collector of families gathered beforehand (prometheus_client's Collector protocol)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def exposition(agent: Agent, *, running: bool = True, now: float | None = None) -> bytes:
    """The file's content: the Prometheus text format, written by prometheus_client."""
    families = agent_families(agent, running=running)
    if agent.flows is not None:
        families += flow_families(agent.flows, now=time.time() if now is None else now)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


class MetricsTextfile:
    def __init__(
        self,
        path: str | Path,
        *,
        log: Callable[..., None],
        interval: float = DEFAULT_INTERVAL_SECONDS,
        soonest: float = SOONEST_SECONDS,
    ) -> None:
        self.path = Path(path)
        self.log, self.interval, self.soonest = log, interval, soonest
        self.failure: str | None = None  # the condition last logged, until a write succeeds
        self._lock = threading.Lock()  # one write at a time, in the order asked
        self._changed = asyncio.Event()  # events bind to a loop only when first awaited
        self._stop = asyncio.Event()

    def changed(self) -> None:
        """Something operators alert on changed: write soon (called on the daemon's loop)."""
        self._changed.set()

    def write(self, data: bytes) -> bool:
        """Replace the file with `data`; False (logged once per condition) when that failed."""
        with self._lock:
            try:
                write_atomically(self.path, data, mode=FILE_MODE)
            except OSError as error:
                # Not the message: it names the temporary file, a new name each time.
                self._failed(error.strerror or type(error).__name__)
                return False
            if self.failure is not None:
                self.failure = None
                self.log("metrics write recovered", path=self.path)
            return True

    def _failed(self, condition: str) -> None:
        if condition != self.failure:
            self.failure = condition
            self.log("metrics write failed", path=self.path, error=condition)

    def _render(self, agent: Agent, *, running: bool) -> bytes | None:
        try:
            return exposition(agent, running=running)
        except Exception as error:  # noqa: BLE001 - a figure that cannot be read must not stop the agent
            self._failed(f"cannot gather the figures: {type(error).__name__}: {error}")
            return None

    async def run(self, agent: Agent) -> None:
        """Until stop(): write now, then every `interval`, or soon after a change."""
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            self._changed.clear()
            written = time.monotonic()
            data = self._render(agent, running=True)
            if data is not None:
                await loop.run_in_executor(None, self.write, data)  # a slow disk must not hold the loop
            if await _wait(self._changed, self.interval):
                await _wait(self._stop, written + self.soonest - time.monotonic())

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()

    def final(self, agent: Agent) -> None:
        """At a clean exit: the file says the agent stopped, and stays."""
        data = self._render(agent, running=False)
        if data is not None:
            self.write(data)


async def _wait(event: asyncio.Event, seconds: float) -> bool:
    """Whether `event` was set within `seconds`."""
    if seconds <= 0:
        return event.is_set()
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        return False
    return True

"""Simulated agents: the real daemon code with an in-memory dataplane, thousands in one process.

Each simulated agent enrols like a real one (its own key and state directory, a fake host name
sim-00001..., addresses from 10.200.0.0/16 and fd00:200::/64) and then runs the real `Agent` on a
shared event loop with a shared pinned TLS context. Nothing touches the kernel: a simulated
agent has no netlink watcher, and its table lives in a RecordingDataplane.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import gc
import ipaddress
import json
import re
import resource
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from agent.collector_time import collector_time
from agent.daemon import HANDSHAKE_SECONDS, Agent
from agent.dataplane import ApplyError, owned_table_problem
from agent.enrol import Pinned, decode_bundle, enrol, pin
from agent.errors import AgentError
from agent.eventlog import EventLog
from agent.state import STATUS_FILE, StateDir, write_atomically
from agent.worker import DataplaneWorker

MAX_AGENTS = 65_000  # the address plan: one IPv4 address per agent in 10.200.0.0/16
IPV4_BASE = ipaddress.IPv4Address("10.200.0.0")
IPV6_BASE = ipaddress.IPv6Address("fd00:200::")
SUMMARY_SECONDS = 10.0


class RecordingDataplane:
    """Keeps the owned table in memory. Checks documents as the real dataplane does before it
    reaches libnftables, so a document that is not just the owned table fails here too."""

    def __init__(self, keep: int | None = None) -> None:
        self.documents: deque[str] = deque(maxlen=keep)  # applied documents, oldest first
        self.current: str | None = None  # the table "in the kernel"
        self.applies = 0
        self.fail_with: str | None = None  # set to make applies fail with this libnftables text

    def apply(self, document: str) -> None:
        problem = owned_table_problem(document) or self.fail_with
        if problem is not None:
            raise ApplyError(problem)
        self.current = document
        self.documents.append(document)
        self.applies += 1

    def table_present(self) -> bool:
        return self.current is not None

    def remove(self) -> bool:
        present, self.current = self.current is not None, None
        return present

    def end_denied(self, document: str) -> int:
        return 0  # no kernel, no open connections


def sim_hostname(index: int) -> str:
    return f"sim-{index:05d}"


def sim_addresses(index: int) -> list[str]:
    if not 1 <= index <= MAX_AGENTS:
        raise AgentError(f"a simulated fleet has at most {MAX_AGENTS} agents")
    return [str(IPV4_BASE + index), str(IPV6_BASE + index)]


STATUS_EVERY_SECONDS = 1.0


class SimulatedStateDir(StateDir):
    """A simulated agent's state directory: its status file written compact, at most once a second.
    The real agent indents status.json for whoever reads it on the host, which takes json's
    pure-Python encoder; a simulator rewrites thousands of them at every stream event, and indenting
    was a fifth of its event loop's CPU (cProfile of 200 agents connecting: 1,400 writes, 1.0 s of
    4.6 s). Compact, the writes were still a sixth of it while 3,000 agents failed over (a connect,
    a refusal, a retry: each an event), so the events of a second share one write of the last state;
    `flush` writes what is due at once (the fleet calls it as it stops)."""

    _status: dict[str, Any] | None = None
    _due: asyncio.TimerHandle | None = None
    _failed: AgentError | None = None

    def write_status(self, status: dict[str, Any]) -> None:
        failed, self._failed = self._failed, None
        self._status = status
        if self._due is None:
            try:
                self._due = asyncio.get_running_loop().call_later(STATUS_EVERY_SECONDS, self.flush)
            except RuntimeError:  # no loop (enrolment's thread): write now
                self.flush()
        if failed is not None:
            raise failed  # the caller logs it, as a write failing now

    def flush(self) -> None:
        if self._due is not None:
            self._due.cancel()
            self._due = None
        status, self._status = self._status, None
        if status is None:
            return
        data = json.dumps(status, sort_keys=True, separators=(",", ":")).encode() + b"\n"
        try:
            write_atomically(self.file(STATUS_FILE), data, durable=False)
        except OSError as error:
            self._failed = AgentError(f"cannot write {self.file(STATUS_FILE)}: {error.strerror or error}")


def _shrink_tls_read_buffers(size: int = 16 * 1024) -> None:
    # asyncio gives every TLS connection a 256 KiB read buffer, most of a simulated agent's
    # memory; a smaller one only means more reads for a large snapshot. Simulator only.
    protocol = getattr(asyncio.sslproto, "SSLProtocol", None)
    if protocol is not None and isinstance(getattr(protocol, "max_size", None), int):
        protocol.max_size = min(protocol.max_size, size)


def _collector_tune() -> FleetCollector:
    # Thousands of agents built once and kept: frozen, the cyclic collector never walks them. Its
    # automatic runs are off: the fleet runs it, through the FleetCollector returned.
    gc.collect()
    gc.freeze()
    gc.disable()
    collector_time.install()
    return FleetCollector()


class FleetCollector:
    """When a simulated fleet's cyclic collector runs: a full collection once every agent has streamed
    for `calm_seconds` and `calm_objects` container objects have been made since the last one, and a
    young one whenever `storm_objects` have, calm or not (memory stays bounded through a storm of
    reconnections).

    Run by allocation counts, as Python runs it, the collector took 22-27 s of the simulators' 54-71 s
    of CPU in a 10,000-agent failover (two full collections of 3.5 s each, the rest young ones walking
    every handshake's objects twice), on the two cores serve needs then. Garbage now waits for a quiet
    fleet, and memory is the price (agent/README.md). serve keeps Python's collector
    (controlplane/management/commands/serve.py)."""

    def __init__(
        self,
        *,
        calm_seconds: float = 30.0,
        calm_objects: int = 200_000,
        storm_objects: int = 5_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.calm_seconds, self.calm_objects, self.storm_objects = calm_seconds, calm_objects, storm_objects
        self.clock = clock
        self._calm_since: float | None = None

    def tick(self, *, calm: bool) -> str | None:
        """Called every few seconds, with whether every agent streams; says which collection ran."""
        made = gc.get_count()[0]  # container objects made, less those freed, since the last collection
        now = self.clock()
        if not calm:
            self._calm_since = None
        elif self._calm_since is None:
            self._calm_since = now
        if (
            self._calm_since is not None
            and now - self._calm_since >= self.calm_seconds
            and made >= self.calm_objects
        ):
            gc.unfreeze()  # the agents' own objects too: a stream closed since then left its cycles
            gc.collect()
            gc.freeze()
            return "full"
        if made >= self.storm_objects:
            gc.collect(1)
            return "young"
        return None


def _raise_open_file_limit() -> None:
    # Each agent holds one socket; the usual soft limit of 1024 stops a fleet of thousands.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


class SimulatedFleet:
    def __init__(
        self,
        agents: list[Agent],
        dataplanes: list[RecordingDataplane],
        log: EventLog,
        *,
        start_rate: float = 200.0,
        tally: StreamTally | None = None,
    ) -> None:
        self.agents = agents
        self.tally = tally or StreamTally()
        self.dataplanes = dataplanes
        self.log = log
        self.start_rate = start_rate  # agents started per second: a whole fleet at once swamps the gateway
        self.collector: FleetCollector | None = None  # set where the automatic collector is off
        self._stopping: asyncio.Event | None = None

    def summary(self) -> dict[str, int]:
        counts = Counter(agent.status.stream_state for agent in self.agents)
        counts["applied"] = sum(1 for agent in self.agents if agent.applied_version is not None)
        counts["agents"] = len(self.agents)
        counts["gc_ms"] = round(sum(collector_time.seconds) * 1000)
        counts["gc_full"] = collector_time.collections[2]
        counts["gc_full_ms"] = round(collector_time.seconds[2] * 1000)
        return dict(counts) | dict(sorted(self.tally.counts.items()))

    async def run(self, duration: float | None = None) -> None:
        """Run every agent until stop(), `duration` seconds, or an agent needs re-enrolment."""
        self._stopping = asyncio.Event()
        reporter = asyncio.ensure_future(self._report())
        runs = [
            asyncio.ensure_future(self._start(agent, i / self.start_rate))
            for i, agent in enumerate(self.agents)
        ]
        try:
            if duration is None:
                await asyncio.gather(*runs)
            else:
                await asyncio.wait(runs, timeout=duration)
        finally:
            self.stop()
            await asyncio.gather(*runs, return_exceptions=True)
            reporter.cancel()
            for agent in self.agents:
                if isinstance(agent.state, SimulatedStateDir):
                    agent.state.flush()
            self.log("fleet stopped", **self.summary())

    async def _start(self, agent: Agent, delay: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), delay)
            return  # stopped before this agent's turn came
        except TimeoutError:
            pass
        await agent.run()

    def stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()
        for agent in self.agents:
            agent.stop("fleet stopping")

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(SUMMARY_SECONDS)
            if self.collector is not None:
                self.collector.tick(calm=all(a.status.stream_state == "connected" for a in self.agents))
            self.log("fleet", **self.summary())


async def start_simulated_fleet(
    bundle_text: str,
    count: int,
    state_root: str | Path,
    *,
    heartbeat_seconds: float = 15.0,
    enrol_workers: int = 16,
    verbose: bool = False,
    log_stream: TextIO | None = None,
    pinned: Pinned | None = None,
    first_index: int = 1,
    open_seconds: float = HANDSHAKE_SECONDS,
) -> SimulatedFleet:
    """Enrol `count` simulated agents numbered from `first_index` (those already enrolled under
    `state_root` are reused) and build them, ready to run. An agent's number gives its host name and
    addresses, and an address belongs to one enrolled workload: simulators sharing a control plane
    need numbers of their own."""
    if count < 1:
        raise AgentError("--count must be at least 1")
    if first_index < 1 or first_index + count - 1 > MAX_AGENTS:
        raise AgentError(
            f"simulated agents are numbered 1 to {MAX_AGENTS}: --first-index and --count leave it"
        )
    root = Path(state_root)
    StateDir(root).create()
    log = EventLog("fleet", log_stream)
    bundle = decode_bundle(bundle_text)
    loop = asyncio.get_running_loop()
    # One handshake and one SSL context for the whole fleet; blocking, so off the loop.
    pinned = pinned or await loop.run_in_executor(None, pin, bundle)
    indexes = range(first_index, first_index + count)
    dirs = {i: root / sim_hostname(i) for i in indexes}
    missing = [i for i in indexes if not StateDir(dirs[i]).is_enrolled()]
    log("enrolling", agents=len(missing), reusing=count - len(missing))

    def enrol_one(i: int) -> None:
        enrol(bundle_text, str(dirs[i]), hostname=sim_hostname(i), addresses=sim_addresses(i), pinned=pinned)

    with ThreadPoolExecutor(max(1, enrol_workers), thread_name_prefix="enrol") as pool:
        jobs = [loop.run_in_executor(pool, enrol_one, i) for i in missing]
        results = await asyncio.gather(*jobs, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        first = failures[0]
        raise AgentError(f"{len(failures)} of {len(missing)} simulated enrolments failed; the first: {first}")

    agents, dataplanes = [], []
    tally = StreamTally()
    for i in indexes:
        dataplane = RecordingDataplane(keep=1)
        agent_log = EventLog(sim_hostname(i), log_stream) if verbose else tally
        agent = Agent(
            SimulatedStateDir(dirs[i]),
            DataplaneWorker.inline(dataplane),
            context=pinned.context,
            heartbeat_seconds=heartbeat_seconds,
            log=agent_log,
            compression=None,  # a deflate context per connection costs more memory than it saves
            open_seconds=open_seconds,
        )
        agents.append(agent)
        dataplanes.append(dataplane)
    log("enrolled", agents=count)
    return SimulatedFleet(agents, dataplanes, log, tally=tally)


class StreamTally:
    """What a quiet fleet's agents did to reach a gateway, counted for the fleet's summary: attempts,
    streams opened and why the others failed. A failover's cost is in the attempts wasted as much as
    in the streams made, and one line every ten seconds says how many there were."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def __call__(self, event: str, **fields: object) -> None:
        if event == "stream connecting":
            self.counts["tries"] += 1
        elif event == "stream connected":
            self.counts["opened"] += 1
        elif event == "stream error":
            self.counts["failed_" + _error_kind(str(fields.get("error", "")))] += 1
        elif event == "stream closed":
            self.counts[f"closed_{fields.get('code')}"] += 1


def _error_kind(message: str) -> str:
    # "the gateway 127.0.0.1:8443: TLS handshake ... (busy)" -> "TLS handshake ... (busy)": one
    # kind for every gateway and every number in it.
    kind = message.split(": ", 1)[-1] if message.startswith("the gateway ") else message
    return re.sub(r"\W+", "_", re.sub(r"\d+", "N", kind)).strip("_")[:60]


def run_simulated_fleet(
    bundle_text: str,
    count: int,
    state_root: str | Path,
    *,
    heartbeat_seconds: float = 15.0,
    duration: float | None = None,
    verbose: bool = False,
    on_started: Callable[[SimulatedFleet], None] | None = None,
    first_index: int = 1,
    start_rate: float = 200.0,
    open_seconds: float = HANDSHAKE_SECONDS,
) -> int:
    """Enrol and run a simulated fleet in this process until SIGTERM/SIGINT or `duration`."""
    _raise_open_file_limit()
    _shrink_tls_read_buffers()

    async def main() -> None:
        fleet = await start_simulated_fleet(
            bundle_text,
            count,
            state_root,
            heartbeat_seconds=heartbeat_seconds,
            verbose=verbose,
            log_stream=sys.stderr,
            first_index=first_index,
            open_seconds=open_seconds,
        )
        fleet.start_rate = start_rate
        fleet.collector = _collector_tune()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, fleet.stop)
        if on_started is not None:
            on_started(fleet)
        await fleet.run(duration)

    asyncio.run(main())
    return 0

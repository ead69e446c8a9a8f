"""The agent's flow evidence loop: sources feed windows, closed windows and gaps go to the buffer, and
the buffer is reported to the gateway (`POST /agent/v1/flows`), independently of the sync stream.

Sources read on their own threads (blocking netlink reads); a source that fails is a `source_restart`
gap until it has subscribed again. While the owned table is gone, every window period carries a
`table_removed` gap; a hand edit of the table that the agent put right is a `table_modified` gap from
its detection to its restoring. A window the control plane refuses as malformed is dropped without retry and
becomes a `window_rejected` gap of its range. While the gateway is unreachable or refuses a report,
reports back off with jitter (1 s doubling to 60 s), and no sooner than a 429 or 503's Retry-After; the
buffer keeps what waits, across restarts too. A report goes to the gateway the last one reached, and when
that one cannot be reached, to the next of the list at once (agent/gateways.py); a report the gateway
stored but could not answer is stored only once when sent again anywhere, its windows being idempotent.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from agent import protocol
from agent.backoff import retry_delay
from agent.flowbuffer import FlowBuffer
from agent.flowreport import instant, report_body
from agent.flowwindow import Gap, Windows
from agent.gateways import CONNECT_SECONDS, Candidate, candidates, silence_bounded
from agent.state import StateDir
from agent.tls import split_gateway

DEFAULT_WINDOW_SECONDS = 60
DEFAULT_NETLINK_BUFFER = 64 << 20  # 64 MiB lost nothing at about 21,000 connections/s
DEFAULT_BUFFER_RECORDS = 10_080  # a week of one-minute windows
DEFAULT_DUMP_MAX = 1_000_000
# Keys one window counts one by one; the rest go to its aggregate keys (agent/flowwindow.py). The
# control plane keeps as many per window (PALISADE_FLOW_WINDOW_MAX_KEYS), so it sums none of ours again.
DEFAULT_WINDOW_KEYS = 10_000
# How many windows and gaps the agent sends in one report at most: fewer than the gateway accepts
# (flows/reports.py, ACCEPTED_MAX_WINDOWS and ACCEPTED_MAX_GAPS; a test keeps them so).
BATCH_MAX_WINDOWS = 200
BATCH_MAX_GAPS = 500
REPORT_BUDGET_BYTES = 8 * 1024 * 1024  # well under the gateway's 32 MiB for flow reports
# Groups one report carries at most (but always one window): what the control plane stores one by one
# per report by default (PALISADE_FLOW_REPORT_MAX_KEYS); it would sum the keys of windows past it.
BATCH_MAX_KEYS = 20_000
SOURCE_RETRY_SECONDS = 1.0
STATUS_EVERY_SECONDS = 5.0  # how often status.json shows the sources and the buffer


def _batch(windows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The oldest windows that fit one report's byte budget and its groups (at least one)."""
    taken, size, keys = [], 0, 0
    for window in windows:
        size += 120 + 230 * len(window["groups"])  # about what each costs in the body
        keys += len(window["groups"])
        if taken and (size > REPORT_BUDGET_BYTES or keys > BATCH_MAX_KEYS):
            break
        taken.append(window)
    return taken


def _answered_items(answer: bytes) -> list[dict[str, Any]]:
    """The windows' and gaps' answers of an accepted report; ValueError (the report is sent again
    later) when the answer is not what the gateway sends, rather than an exception the loop would
    not expect."""
    results = json.loads(answer)
    lists = [results.get(name, []) for name in ("windows", "gaps")] if isinstance(results, dict) else [None]
    items = [item for listed in lists if isinstance(listed, list) for item in listed]
    if not all(isinstance(listed, list) for listed in lists) or not all(
        isinstance(item, dict) and isinstance(item.get("id"), str | None) for item in items
    ):
        raise ValueError("the gateway's answer to a flow report is not one of its answers")
    return items


def _expired(expires_at: str, now: float) -> bool:
    try:
        return datetime.fromisoformat(expires_at.replace("Z", "+00:00")).timestamp() <= now
    except ValueError:
        return False


class Source(Protocol):
    gaps: list[Gap]

    def subscribe(self) -> None: ...
    def read_once(self, timeout: float) -> int: ...
    def close(self) -> None: ...


@dataclass
class FlowSettings:
    window_seconds: int = DEFAULT_WINDOW_SECONDS
    netlink_buffer: int = DEFAULT_NETLINK_BUFFER
    buffer_records: int = DEFAULT_BUFFER_RECORDS
    dump_max: int = DEFAULT_DUMP_MAX
    window_keys: int = DEFAULT_WINDOW_KEYS


class LockedWindows(Windows):
    """Windows shared by the source threads, which observe under `lock` (a batch of events per
    acquisition: once per event cost a tenth of the source's CPU), and the reporting loop."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.lock = threading.Lock()

    def close_due(self, now, policy_version):  # type: ignore[no-untyped-def]
        with self.lock:
            return super().close_due(now, policy_version)

    def open_keys(self) -> int:
        with self.lock:
            return super().open_keys()


class SourceThread:
    """Runs one source until stopped; a failure is a `source_restart` gap until it subscribes again."""

    def __init__(self, name: str, source: Source, log: Callable[..., None], clock: Callable[[], float]):
        self.name, self.source, self.log, self.clock = name, source, log, clock
        self.stopping = threading.Event()
        self.restart_gaps: list[Gap] = []
        self.subscribed = False
        self.down_reason: str | None = None  # why it is down, while it is
        self.restarts = 0  # times it went down (each then retried until it subscribes again)
        self.last_read_at: float | None = None
        self.thread = threading.Thread(target=self._run, name=f"flow-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        down_since: float | None = None
        while not self.stopping.is_set():
            try:
                if not self.subscribed:
                    self.source.subscribe()
                    self.subscribed, self.down_reason = True, None
                    if down_since is not None:
                        self.restart_gaps.append(
                            Gap("source_restart", self.name, down_since, self.clock(), {})
                        )
                        self.log("flow source subscribed again", source=self.name)
                        down_since = None
                if self.source.read_once(0.5):
                    self.last_read_at = self.clock()
            except OSError as error:
                reason = error.strerror or str(error)
                if reason != self.down_reason:  # once per failure, not once per retry
                    self.log("flow source failed", source=self.name, error=reason)
                if down_since is None:
                    self.restarts += 1
                self.source.close()
                self.subscribed, self.down_reason = False, reason
                down_since = down_since or getattr(error, "since", None) or self.clock()
                self.stopping.wait(SOURCE_RETRY_SECONDS)
        self.source.close()

    def overruns(self) -> int:
        return int(getattr(getattr(self.source, "counter", None), "overruns", 0))

    def events_read(self) -> int:
        return int(getattr(getattr(self.source, "counter", None), "events_read", 0))

    def take_gaps(self) -> list[Gap]:
        """The gaps recorded since the last call (the source thread only appends)."""
        taken = []
        for gaps in (self.source.gaps, self.restart_gaps):
            count = len(gaps)
            taken.extend(gaps[:count])
            del gaps[:count]
        return taken

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)


class FlowReporter:
    def __init__(
        self,
        state: StateDir,
        *,
        settings: FlowSettings,
        context: Callable[[], ssl.SSLContext],
        policy_version: Callable[[], str],
        table_absent: Callable[[], bool],
        process_start_id: str,
        log: Callable[..., None],
        sources: dict[str, Callable[[Windows], Source]],
        accounting: bool,
        clock: Callable[[], float] = time.time,
        control_plane_clock: Callable[[], float] | None = None,
        on_status: Callable[[dict[str, Any]], None] | None = None,
    ):
        """`clock` times the evidence (this host's clock; the control plane measures its skew);
        `control_plane_clock` judges the credential's expiry, a time the control plane set."""
        self.state, self.settings = state, settings
        self.context, self.policy_version, self.table_absent = context, policy_version, table_absent
        self.process_start_id, self.log, self.clock = process_start_id, log, clock
        self.control_plane_clock = control_plane_clock or clock
        self.started = time.monotonic()
        self.windows = LockedWindows(
            length=float(settings.window_seconds), max_keys=settings.window_keys, accounting=accounting
        )
        self.buffer = FlowBuffer(state.path, max_records=settings.buffer_records)
        self.threads = [SourceThread(name, make(self.windows), log, clock) for name, make in sources.items()]
        self.period_start = math.floor(clock() / settings.window_seconds) * settings.window_seconds
        self.absent_since: float | None = None
        self.modified: list[tuple[float, float]] = []  # hand edits of the table: (seen, restored)
        self.attempt = 0
        self.next_send = 0.0
        self.retry_after: float | None = None  # what the gateway's last 503 or 429 asked for
        self.last_acknowledged: str | None = None
        # A new process reports once at start, even with nothing to say: that report is what lets the
        # control plane record the silence before it (agent_silent), which a quiet workload would
        # otherwise leave unrecorded until its first connection.
        self.announced = False
        self.on_status = on_status
        self.status_at = 0.0
        self.status_sources: tuple[tuple[bool, int], ...] = ()
        self.gateway: Candidate | None = None  # the gateway the last report reached

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _table_gaps(self, now: float) -> list[Gap]:
        """`table_removed` over each whole or partial window period the table was gone in."""
        gaps = []
        if self.table_absent():
            self.absent_since = self.absent_since if self.absent_since is not None else now
        length = self.settings.window_seconds
        while self.period_start + length <= now:
            end = self.period_start + length
            if self.absent_since is not None and self.absent_since < end:
                gaps.append(Gap("table_removed", None, max(self.absent_since, self.period_start), end, {}))
            self.period_start = end
            if not self.table_absent():
                self.absent_since = None
            elif self.absent_since is not None:
                self.absent_since = max(self.absent_since, end)
        return gaps

    def table_modified(self, seen: float, restored: float) -> None:
        """Another process edited the owned table at `seen`, and it was put right at `restored` (this
        host's clock): the evidence between followed rules that were not the policy's."""
        self.modified.append((seen, max(restored, seen + 0.001)))

    def tick(self, now: float | None = None) -> None:
        """Close what is due and move it, with every source's gaps, into the buffer."""
        now = self.clock() if now is None else now
        taken, self.modified = self.modified, []
        edits = [Gap("table_modified", None, seen, restored, {}) for seen, restored in taken]
        self._keep(now, self._table_gaps(now) + edits)

    def close(self) -> None:
        """At shutdown: the open window is closed and kept, with the rest of the buffer."""
        for thread in self.threads:
            thread.stop()
        self._keep(math.inf, [])

    def _keep(self, now: float, gaps: list[Gap]) -> None:
        closed, window_gaps = self.windows.close_due(now, self.policy_version())
        gaps = window_gaps + gaps
        for thread in self.threads:
            gaps.extend(thread.take_gaps())
        if closed or gaps:
            self.buffer.add(closed, gaps)

    # --- reporting ---

    def send_pending(self) -> bool | None:
        """Report what waits (one batch), and a new process's first report even when nothing does; True
        when acknowledged, False on failure, None if nothing was sent."""
        self.retry_after = None
        windows, gaps = self.buffer.pending()
        if not windows and not gaps and self.announced:
            return None
        windows, gaps = _batch(windows[:BATCH_MAX_WINDOWS]), gaps[:BATCH_MAX_GAPS]
        enrolment = self.state.load_enrolment()  # the credential changes at each renewal
        if _expired(enrolment.expires_at, self.control_plane_clock()):
            # An expired credential only renews, on the stream; reports wait in the buffer until then.
            self.log("flow report waits for the credential's renewal")
            return False
        body = report_body(
            windows,
            gaps,
            now=self.clock(),
            process_start_id=self.process_start_id,
            uptime_seconds=time.monotonic() - self.started,
            window_seconds=self.settings.window_seconds,
        )
        headers = enrolment.flow_report_headers(body)
        connection = self._connect(self.state.load_gateways(enrolment.identity))
        try:
            try:
                connection.request("POST", protocol.FLOWS_PATH, body=body, headers=headers)
            except OSError as sending:
                # The gateway answers from the headers alone when it refuses them or has no room for the
                # body yet, and closes while the body is still being sent: its answer says which.
                if connection.sock is None:
                    raise
                try:
                    response = connection.getresponse()
                except (OSError, http.client.HTTPException):
                    raise sending from None
            else:
                response = connection.getresponse()
            answer = response.read()
        finally:
            connection.close()
        if response.status != 200:
            self.retry_after = protocol.retry_after(response.status, response.getheader("Retry-After"))
            detail = ""
            try:
                problem = json.loads(answer)
                detail = str(problem.get("detail", "")) if isinstance(problem, dict) else ""
            except ValueError:
                pass
            self.log("flow report refused", status=response.status, detail=detail[:200])
            return False
        done: set[str] = set()
        rejected = []
        by_id = {w["id"]: w for w in windows}
        for result in _answered_items(answer):
            if result.get("id"):
                done.add(result["id"])
            if result.get("result") == "refused" and result.get("id") in by_id:
                window = by_id[result["id"]]
                rejected.append(Gap("window_rejected", None, window["start"], window["end"], {"windows": 1}))
                self.log("flow window refused", window=result["id"], reason=result.get("reason"))
        self.announced = True
        self.buffer.acknowledge(done)
        if rejected:
            self.buffer.add([], rejected)
        if windows:
            self.last_acknowledged = windows[-1]["id"]
        return True

    def _connect(self, gateways: list[str]) -> http.client.HTTPSConnection:
        """A TLS connection to the gateway the last report reached, else to the first of the others that
        answers; the OSError of the last one tried when none does."""
        found = candidates(gateways)
        if self.gateway in found:
            found.remove(self.gateway)
            found.insert(0, self.gateway)
        failure: OSError = OSError("no gateway to report to")
        for candidate in found:
            try:
                sock = socket.create_connection((candidate.host, candidate.port), timeout=CONNECT_SECONDS)
            except OSError as error:
                failure = error
                if candidate == self.gateway:
                    self.log("flow report gateway unreachable", gateway=candidate.label, error=str(error))
                continue
            try:
                sock.settimeout(30)
                silence_bounded(sock)  # a report in flight to a host gone silent fails in 6 s, not 30
                connection = http.client.HTTPSConnection(
                    split_gateway(candidate.address)[0], candidate.port, context=self.context(), timeout=30
                )
                connection.sock = self.context().wrap_socket(sock)
            except BaseException:
                sock.close()
                raise
            if candidate != self.gateway:
                self.log("flow reports go to", gateway=candidate.label)
            self.gateway = candidate
            return connection
        raise failure

    async def run(self, stopping: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        self.start()
        try:
            while not stopping.is_set():
                self.tick()
                # Every few seconds, and at once when a source goes down, comes back or overruns.
                sources = tuple((t.subscribed, t.overruns()) for t in self.threads)
                due = time.monotonic() - self.status_at >= STATUS_EVERY_SECONDS
                if self.on_status is not None and (due or sources != self.status_sources):
                    self.status_at, self.status_sources = time.monotonic(), sources
                    self.on_status(self.status())
                if time.monotonic() >= self.next_send:
                    try:
                        sent = await loop.run_in_executor(None, self.send_pending)
                    except (OSError, http.client.HTTPException, ValueError) as error:
                        self.log("flow report failed", error=getattr(error, "strerror", None) or str(error))
                        sent = False
                    if sent is False:
                        self.next_send = time.monotonic() + self.delay_after_failure()
                    elif sent:
                        self.attempt = 0
                        continue  # more may wait: send the next batch at once
                try:
                    await asyncio.wait_for(stopping.wait(), 1.0)
                except TimeoutError:
                    pass
        finally:
            await loop.run_in_executor(None, self.close)

    def delay_after_failure(self) -> float:
        """Jittered backoff, and after a 503 or 429 no sooner than its Retry-After, spread over as long
        again (agent/backoff.py)."""
        delay = retry_delay(self.attempt, self.retry_after)
        self.retry_after = None
        self.attempt += 1
        return delay

    def backlog_since(self) -> str | None:
        """The start of the oldest window or gap not acknowledged yet, None when there is none: the
        control plane cannot vouch for a range from then on until it is delivered (sent on heartbeats,
        which reach it while flow reports cannot)."""
        windows, gaps = self.buffer.pending()
        starts = [record["start"] for record in (*windows, *gaps)]
        return instant(min(starts)) if starts else None

    def status(self) -> dict[str, Any]:
        windows, gaps = self.buffer.pending()
        return {
            "sources": {
                t.name: {
                    "subscribed": t.subscribed,
                    "down_reason": t.down_reason,
                    "last_event_at": (
                        datetime.fromtimestamp(t.last_read_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                        if t.last_read_at
                        else None
                    ),
                    "overruns": t.overruns(),
                }
                for t in self.threads
            },
            "open_window_keys": self.windows.open_keys(),
            "buffer": {"windows": len(windows), "gaps": len(gaps), "capacity": self.settings.buffer_records},
            "last_acknowledged_window": self.last_acknowledged,
        }

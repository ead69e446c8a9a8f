"""The agent's metrics textfile (agent/metrics.py): each figure follows its source, the file is replaced
atomically, a failed write is logged once and stops nothing, and every name is documented. The real
daemon writing it in a namespace, checked by promtool: test_daemon_netns.py."""

from __future__ import annotations

import asyncio
import io
import os
import re
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent import conntrack, flowreporter, metrics, nflog
from agent.credential import credential_parse, parse_instant
from agent.daemon import Agent
from agent.enrol import enrol
from agent.eventlog import EventLog
from agent.flowreporter import FlowReporter, FlowSettings
from agent.flowwindow import ClosedWindow, Gap, Windows
from agent.simulated import RecordingDataplane
from agent.state import StateDir
from agent.worker import DataplaneWorker
from tests.support.agent_helpers import assert_one_line_error, document, metric_samples, run_cli
from tests.support.agent_helpers import metric_value as value
from tests.support.fake_gateway import FakeGateway

REPO = Path(__file__).resolve().parents[2]


def read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


async def until(path: Path, predicate, timeout: float = 10.0) -> str:
    """The file's text once `predicate(text)` holds; fails with the last text after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        text = read(path)
        if text and predicate(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s; the file holds:\n{text}")
        await asyncio.sleep(0.02)


# --- the daemon's own figures, against the stand-in gateway ---


def test_the_daemon_writes_its_figures_on_each_change_and_a_stopped_file_at_exit(tmp_path):
    path = tmp_path / "textfile" / "palisade-agent.prom"
    path.parent.mkdir()

    async def main() -> None:
        gateway = await FakeGateway(tmp_path / "gateway").start()
        try:
            state_dir = str(tmp_path / "state")
            bundle = gateway.bundle(gateway.add_token())
            loop = asyncio.get_running_loop()
            identity = await loop.run_in_executor(
                None, lambda: enrol(bundle, state_dir, hostname="web-1", addresses=["10.0.0.5"])
            )
            workload = identity.workload_id
            dataplane = RecordingDataplane()
            logs = io.StringIO()
            # A long interval: every write the test waits for comes from a change, not from the clock.
            textfile = metrics.MetricsTextfile(path, log=EventLog(stream=logs), interval=600, soonest=0.05)
            agent = Agent(
                StateDir(state_dir), DataplaneWorker.inline(dataplane), heartbeat_seconds=30,
                log=EventLog(stream=logs), metrics=textfile,
            )  # fmt: skip
            await gateway.push_snapshot(workload, "v1", document("v1"), mode="simulation")
            task = asyncio.ensure_future(agent.run())

            text = await until(path, lambda t: value(t, "palisade_agent_applied_version_info",
                                                     version="v1", mode="simulation") == 1)  # fmt: skip
            await until(path, lambda t: value(t, "palisade_agent_stream_connected") == 1)
            text = await until(path, lambda t: value(t, "palisade_agent_owned_table", state="present") == 1)
            assert value(text, "palisade_agent_owned_table", state="absent") == 0
            assert value(text, "palisade_agent_owned_table", state="unknown") == 0
            assert value(text, "palisade_agent_running") == 1
            assert value(text, "palisade_agent_apply_failures_total") == 0
            assert value(text, "palisade_agent_info", agent_version="0.1.0", workload_id=workload) == 1
            status = agent.status.data
            assert value(text, "palisade_agent_applied_timestamp_seconds") == (
                parse_instant(status["applied"]["at"]).timestamp()
            )
            assert value(text, "palisade_agent_start_time_seconds") == (
                parse_instant(status["started_at"]).timestamp()
            )
            credential = status["credential"]  # as the welcome gave them
            expiry = value(text, "palisade_agent_credential_expiry_timestamp_seconds")
            assert expiry == parse_instant(credential["expires_at"]).timestamp()
            assert value(text, "palisade_agent_credential_renewal_due_timestamp_seconds") == (
                parse_instant(credential["renewal_due_at"]).timestamp()
            )
            # No flow figures: this agent runs no flow evidence loop.
            assert not any(name.startswith("palisade_agent_flow_") for name, _ in metric_samples(text))

            # A refused snapshot: counted, and the applied version stays what the kernel holds.
            dataplane.fail_with = "document:3:5-9: Error: syntax error, unexpected junk"
            await gateway.push_snapshot(workload, "v2", document("v2"))
            text = await until(path, lambda t: value(t, "palisade_agent_apply_failures_total") == 1)
            assert value(text, "palisade_agent_applied_version_info", version="v1", mode="simulation") == 1
            assert value(text, "palisade_agent_applied_version_info", version="v2", mode="enforced") is None

            dataplane.fail_with = None
            await gateway.push_snapshot(workload, "v3", document("v3"))
            text = await until(path, lambda t: value(t, "palisade_agent_applied_version_info",
                                                     version="v3", mode="enforced") == 1)  # fmt: skip
            # One current version only: the label's values do not pile up.
            assert [n for n, _ in metric_samples(text)].count("palisade_agent_applied_version_info") == 1

            # The watcher's verdict moves the table's figure.
            agent.table_event("absent")
            text = await until(path, lambda t: value(t, "palisade_agent_owned_table", state="absent") == 1)
            assert value(text, "palisade_agent_owned_table", state="present") == 0

            # The stream goes: disconnected; connected again, with a renewal due at once.
            gateway.welcome_renewal_due_seconds = -1
            # Told to come back in 1 s: without a wait the agent's backoff may reconnect within the
            # file's 50 ms between writes (seen in CI: 9 ms), and the file never holds the 0.
            await gateway.close_stream(workload, 4503, "shutting down: retry after 1 s")
            await until(path, lambda t: value(t, "palisade_agent_stream_connected") == 0)
            await until(path, lambda t: value(t, "palisade_agent_stream_connected") == 1)

            # The renewed credential's expiry.
            def renewed(t: str) -> bool:
                stored = credential_parse(agent.state.load_credential())["expires_at"]
                figure = value(t, "palisade_agent_credential_expiry_timestamp_seconds")
                return figure != expiry and figure == parse_instant(stored).timestamp()

            await until(path, renewed)

            agent.stop("test")
            await asyncio.wait_for(task, 15)
            text = read(path)
            assert value(text, "palisade_agent_running") == 0
            assert value(text, "palisade_agent_stream_connected") == 0
            assert value(text, "palisade_agent_applied_version_info", version="v3", mode="enforced") == 1
            assert "metrics write failed" not in logs.getvalue()
            assert os.stat(path).st_mode & 0o777 == 0o644
            assert sorted(p.name for p in path.parent.iterdir()) == ["palisade-agent.prom"]  # nothing aside
            documented(text)
        finally:
            await gateway.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def documented(text: str) -> None:
    """Every family in `text` has a row `| name | type | meaning |` in docs/metrics.md's agent section."""
    doc = (REPO / "docs" / "metrics.md").read_text()
    section = doc.split("## Agent (textfile collector)", 1)[1].split("\n## ", 1)[0]
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\| `([a-z_]+)(?:\{[^`]*\})?` \| (\w+) \|", section, re.M)
    }
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        assert rows.get(name) == family.type, f"{name} ({family.type}) is not documented as such"


# --- the flow figures ---


class Scripted:
    """A flow source whose failures the test decides: subscribe fails while `refuse` is set, a read
    fails once when `fail_read` is set."""

    def __init__(self, counter) -> None:
        self.counter = counter
        self.gaps: list[Gap] = []
        self.refuse = threading.Event()
        self.fail_read = threading.Event()
        self.events: list[int] = []  # batches to read
        self.subscribes = 0

    def subscribe(self) -> None:
        self.subscribes += 1
        if self.refuse.is_set():
            raise OSError(1, "Operation not permitted")

    def read_once(self, timeout: float) -> int:
        if self.fail_read.is_set():
            self.fail_read.clear()
            raise OSError(5, "Input/output error")
        if self.events:
            count = self.events.pop(0)
            self.counter.events_read += count
            return count
        time.sleep(0.01)  # a quiet socket: read_once blocks until its timeout
        return 0

    def close(self) -> None:
        pass


def wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.01)


def flows_text(reporter: FlowReporter, now: float) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics._Families(metrics.flow_families(reporter, now=now)))
    return generate_latest(registry).decode()


def test_each_flow_source_figure_follows_its_source(tmp_path, monkeypatch):
    monkeypatch.setattr(flowreporter, "SOURCE_RETRY_SECONDS", 0.01)
    state = StateDir(tmp_path)
    state.create()
    windows = Windows(length=60, max_keys=100, accounting=False)
    made: dict[str, Scripted] = {}

    def make(name, counter):
        def build(_windows):
            made[name] = Scripted(counter)
            made[name].refuse.set() if name == "nflog" else None
            return made[name]

        return build

    reporter = FlowReporter(
        state, settings=FlowSettings(buffer_records=50), context=lambda: None,  # type: ignore[arg-type, return-value]
        policy_version=lambda: "v", table_absent=lambda: False, process_start_id="p", log=lambda *a, **k: None,
        sources={"conntrack": make("conntrack", conntrack.ConntrackCounter(windows)),
                 "nflog": make("nflog", nflog.BlockedCounter(windows))},
        accounting=False,
    )  # fmt: skip
    ct, nf = made["conntrack"], made["nflog"]
    reporter.start()
    try:
        ct.events += [3, 4]
        wait(lambda: reporter.threads[0].events_read() == 7)
        wait(lambda: nf.subscribes >= 3)  # refused from the start: down, and retried
        text = flows_text(reporter, time.time())
        assert value(text, "palisade_agent_flow_source_up", source="conntrack") == 1
        assert value(text, "palisade_agent_flow_source_up", source="nflog") == 0
        assert value(text, "palisade_agent_flow_source_events_total", source="conntrack") == 7
        assert value(text, "palisade_agent_flow_source_restarts_total", source="conntrack") == 0
        # Once for the spell it was down, not once a retry.
        assert value(text, "palisade_agent_flow_source_restarts_total", source="nflog") == 1

        nf.refuse.clear()
        wait(lambda: reporter.threads[1].subscribed)
        ct.fail_read.set()  # a running source fails: one restart, up again after
        wait(lambda: reporter.threads[0].restarts == 1 and reporter.threads[0].subscribed)
        ct.counter.overruns += 2  # what ConntrackCounter.overrun() counts
        text = flows_text(reporter, time.time())
        assert value(text, "palisade_agent_flow_source_up", source="nflog") == 1
        assert value(text, "palisade_agent_flow_source_restarts_total", source="conntrack") == 1
        assert value(text, "palisade_agent_flow_source_restarts_total", source="nflog") == 1
        assert value(text, "palisade_agent_flow_source_overruns_total", source="conntrack") == 2
        assert value(text, "palisade_agent_flow_source_overruns_total", source="nflog") == 0
    finally:
        for thread in reporter.threads:
            thread.stop()


def test_the_counters_count_what_the_sources_read():
    windows = Windows(length=60, max_keys=100, accounting=True)
    counting = conntrack.ConntrackCounter(windows)
    entry = conntrack.Entry(False, 1, 6, "10.0.0.2", "10.0.0.1", 443, 40001, (2 << 24) | 7, None, None, None)
    counting.events([entry, entry], 10.0)
    counting.events([], 11.0)
    assert counting.events_read == 2
    assert counting.overrun(since=9.0, at=12.0).kind == "source_overrun" and counting.overruns == 1

    blocked = nflog.BlockedCounter(windows)
    # An IPv4 header (protocol TCP, 10.0.0.9 -> 10.0.0.1), then the ports.
    syn = bytes([0x45, *bytes(8), 6, 0, 0, 10, 0, 0, 9, 10, 0, 0, 1]) + bytes.fromhex("9c400016")
    blocked.packet(syn, 10.0)
    blocked.packet(syn, 10.5)  # a retransmit: one attempt, two packets read
    assert blocked.events_read == 2


def test_the_buffer_figures_and_the_oldest_unacknowledged_age(tmp_path):
    state = StateDir(tmp_path)
    state.create()
    reporter = FlowReporter(
        state, settings=FlowSettings(buffer_records=3), context=lambda: None,  # type: ignore[arg-type, return-value]
        policy_version=lambda: "v", table_absent=lambda: False, process_start_id="p", log=lambda *a, **k: None,
        sources={}, accounting=False,
    )  # fmt: skip
    text = flows_text(reporter, 1000.0)
    assert value(text, "palisade_agent_flow_buffer_windows") == 0
    assert value(text, "palisade_agent_flow_buffer_capacity_windows") == 3
    assert value(text, "palisade_agent_flow_oldest_unacknowledged_age_seconds") == 0

    def window(n: int) -> ClosedWindow:
        return ClosedWindow(f"w{n}", 60.0 * n, 60.0 * (n + 1), "v", False, ())

    reporter.buffer.add([window(10), window(11)], [Gap("source_restart", "nflog", 600.0, 650.0, {})])
    text = flows_text(reporter, 1000.0)
    assert value(text, "palisade_agent_flow_buffer_windows") == 2
    assert value(text, "palisade_agent_flow_buffer_gaps") == 1
    # The gap, ended at 650, is the oldest.
    assert value(text, "palisade_agent_flow_oldest_unacknowledged_age_seconds") == 350.0

    gap_id = reporter.buffer.gaps[0]["id"]
    reporter.buffer.acknowledge({gap_id, "w10"})
    text = flows_text(reporter, 1000.0)
    assert value(text, "palisade_agent_flow_buffer_windows") == 1
    assert value(text, "palisade_agent_flow_buffer_gaps") == 0
    assert value(text, "palisade_agent_flow_oldest_unacknowledged_age_seconds") == 1000.0 - 720.0

    reporter.buffer.add([window(12), window(13), window(14)], [])  # one more than it holds
    text = flows_text(reporter, 1000.0)
    assert value(text, "palisade_agent_flow_buffer_windows") == 3
    assert value(text, "palisade_agent_flow_buffer_gaps") == 1  # the overflow's


# --- the file ---


def test_the_file_is_written_aside_in_its_directory_synced_and_renamed(tmp_path, monkeypatch):
    path = tmp_path / "palisade-agent.prom"
    textfile = metrics.MetricsTextfile(path, log=lambda *a, **k: None)
    seen: list[tuple[str, str, bytes]] = []
    synced: list[int] = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(source, target):
        seen.append((str(source), str(target), Path(source).read_bytes()))
        real_replace(source, target)

    def fsync(fd):
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    old = os.umask(0o077)  # the unit's UMask
    try:
        assert textfile.write(b"palisade_agent_running 1\n")
    finally:
        os.umask(old)
    ((source, target, data),) = seen
    assert target == str(path) and data == b"palisade_agent_running 1\n"
    assert Path(source).parent == path.parent and Path(source).name != path.name
    assert not source.endswith(".prom")  # node_exporter never reads the half-written file
    assert synced, "the data is synced before the rename"
    assert path.read_bytes() == data and os.stat(path).st_mode & 0o777 == 0o644


def test_a_reader_never_sees_part_of_a_file(tmp_path):
    path = tmp_path / "palisade-agent.prom"
    textfile = metrics.MetricsTextfile(path, log=lambda *a, **k: None)
    contents = [f"# {n}\n".encode() + b"palisade_agent_running 1\n" * (1 + 3000 * (n % 2)) for n in range(2)]
    textfile.write(contents[0])
    bad: list[bytes] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            data = path.read_bytes()
            if data not in contents:
                bad.append(data)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for n in range(300):
            assert textfile.write(contents[n % 2])
    finally:
        done.set()
        thread.join()
    assert bad == [], f"{len(bad)} partial reads, e.g. {len(bad[0])} bytes"


def test_a_failed_write_is_logged_once_per_condition_and_recovers(tmp_path):
    logs = io.StringIO()
    path = tmp_path / "missing" / "palisade-agent.prom"
    textfile = metrics.MetricsTextfile(path, log=EventLog(stream=logs))
    assert [textfile.write(b"x 1\n") for _ in range(3)] == [False] * 3
    (tmp_path / "missing").mkdir()
    assert textfile.write(b"x 1\n")
    (tmp_path / "missing" / "palisade-agent.prom").unlink()
    (tmp_path / "missing").rmdir()
    (tmp_path / "missing").write_text("a file where the directory was")
    assert [textfile.write(b"x 1\n") for _ in range(2)] == [False] * 2
    lines = [line.split(" ", 1)[1].split(" path=")[0] for line in logs.getvalue().splitlines()]
    assert lines == ["metrics write failed", "metrics write recovered", "metrics write failed"], lines
    text = logs.getvalue()
    assert 'error="No such file or directory"' in text and 'error="Not a directory"' in text


def test_the_agent_runs_on_when_the_file_cannot_be_written(tmp_path):
    """The loop itself: a directory that is not there is logged once, and the daemon's figures still
    reach the file once it is."""
    logs = io.StringIO()
    path = tmp_path / "later" / "palisade-agent.prom"

    class Stub:
        flows = None
        apply_failures = 0
        denied_connections_ended = 0
        owned_table = "unknown"
        table_modifications = 0
        expires_at = "2026-12-01T00:00:00Z"
        renewal_due_at = None

        class identity:  # noqa: N801 - stands in for an attribute
            workload_id = "w-1"

        class status:  # noqa: N801
            data = {"started_at": "2026-11-27T10:00:00Z", "applied": None}
            stream_state = "connecting"

    async def main() -> None:
        textfile = metrics.MetricsTextfile(path, log=EventLog(stream=logs), interval=0.05, soonest=0.01)
        task = asyncio.ensure_future(textfile.run(Stub()))  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while "metrics write failed" not in logs.getvalue():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        (tmp_path / "later").mkdir()
        text = await until(path, lambda t: value(t, "palisade_agent_running") == 1)
        expiry = 1796083200.0  # 2026-12-01T00:00:00Z
        assert value(text, "palisade_agent_credential_expiry_timestamp_seconds") == expiry
        assert value(text, "palisade_agent_applied_timestamp_seconds") is None  # nothing applied yet
        textfile.stop()
        await asyncio.wait_for(task, 5)
        textfile.final(Stub())  # type: ignore[arg-type]
        assert value(read(path), "palisade_agent_running") == 0

    asyncio.run(main())
    assert logs.getvalue().count("metrics write failed") == 1
    assert logs.getvalue().count("metrics write recovered") == 1


# --- the command line ---


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--metrics-textfile", "/tmp/palisade-agent.txt"], "must end in .prom"),
        (["--metrics-textfile", "/tmp/a.prom", "--metrics-interval-seconds", "0"], "must be positive"),
    ],
)
def test_a_metrics_path_node_exporter_would_never_read_is_refused(tmp_path, args, fragment):
    done = run_cli("run", "--state-dir", str(tmp_path), *args)
    assert done.returncode == 1
    assert_one_line_error(done, fragment)

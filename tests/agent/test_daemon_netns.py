"""`palisade-agent run` as a real process in a network namespace (root): real nftables, the real
netlink watcher, the kill switch, a resend, SIGTERM, and the 4403 stop. The stand-in gateway runs
in the same namespace, on its loopback."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.agent_helpers import REPO, document, metric_value, run_cli
from tests.support.netns import Lab, require_namespace_lab
from tests.support.requirements import require

pytestmark = pytest.mark.root

GATEWAY = "import asyncio, sys\nfrom tests.support.fake_gateway import _serve_process\nasyncio.run(_serve_process(sys.argv[1]))"


class Lines:
    """Lines of a process's stream, gathered by a thread, waited on with a timeout."""

    def __init__(self, stream) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))

    def wait(self, predicate, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                line = self._queue.get(timeout=max(0.01, remaining))
            except queue.Empty:
                raise AssertionError(
                    f"nothing matching within {timeout} s; saw:\n" + "\n".join(self.seen)
                ) from None
            self.seen.append(line)
            if predicate(line):
                return line

    def drain(self, seconds: float) -> list[str]:
        end, got = time.monotonic() + seconds, []
        while (remaining := end - time.monotonic()) > 0:
            try:
                got.append(self._queue.get(timeout=remaining))
            except queue.Empty:
                break
        self.seen += got
        return got


def _event(text: str) -> str:
    """The event part of a daemon log line (after the timestamp)."""
    return text.split(" ", 1)[1] if " " in text else text


def test_run_in_a_namespace(tmp_path):
    require_namespace_lab()
    state = str(tmp_path / "state")
    with Lab.create({"wl": (None, None)}) as lab:
        ns = lab.ns("wl")
        gateway = lab.popen_python("wl", GATEWAY, str(tmp_path / "gateway"))
        daemon = None
        try:
            gateway_out = Lines(gateway.stdout)
            ready = json.loads(gateway_out.wait(lambda line: line.startswith('{"ready"')))

            def command(**op) -> None:
                gateway.stdin.write(json.dumps(op) + "\n")
                gateway.stdin.flush()
                gateway_out.wait(lambda line: json.loads(line).get("kind") == "done")

            def gateway_saw(kind: str, **match) -> dict:
                def matches(line: str) -> bool:
                    event = json.loads(line)
                    return event.get("kind") == kind and all(event.get(k) == v for k, v in match.items())

                return json.loads(gateway_out.wait(matches))

            enrolled = run_cli("enrol", "--bundle", ready["bundle"], "--state-dir", state, netns=ns)
            assert enrolled.returncode == 0, enrolled.stderr
            workload = json.loads((tmp_path / "state" / "identity.json").read_text())["workload_id"]
            command(op="snapshot", workload=workload, version="v1", document=document("v1"))

            daemon = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "agent", "run", "--state-dir", state,
                 "--heartbeat-seconds", "1"],
                stderr=subprocess.PIPE, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            )  # fmt: skip
            log = Lines(daemon.stderr)
            log.wait(lambda line: _event(line).startswith("stream connected"))
            log.wait(lambda line: _event(line) == "applied version=v1 mode=enforced")
            assert "tcp dport 22 accept" in lab.run("wl", ["nft", "list", "table", "inet", "palisade"]).stdout

            # A replace is not a delete.
            command(op="snapshot", workload=workload, version="v2", document=document("v2", port=2222))
            log.wait(lambda line: _event(line) == "applied version=v2 mode=enforced")
            gateway_saw("message", type="applied")

            # The local kill switch: reported absent, never restored by the agent.
            removed = run_cli("remove-table", "--state-dir", state, netns=ns)
            assert removed.returncode == 0, removed.stderr
            log.wait(lambda line: _event(line) == "table absent", timeout=5)
            gateway_saw("message", type="table")
            log.drain(2.5)  # two heartbeats pass
            assert lab.run("wl", ["nft", "list", "table", "inet", "palisade"]).returncode != 0

            # The operator's resend restores it.
            command(op="resend", workload=workload)
            log.wait(lambda line: _event(line) == "reconnect requested reason=resend-snapshot")
            log.wait(lambda line: _event(line) == "applied version=v2 mode=enforced")
            log.wait(lambda line: _event(line) == "table present")
            assert (
                "tcp dport 2222 accept" in lab.run("wl", ["nft", "list", "table", "inet", "palisade"]).stdout
            )

            # An outside `nft delete` is the same kill switch.
            assert lab.run("wl", ["nft", "delete", "table", "inet", "palisade"]).returncode == 0
            log.wait(lambda line: _event(line) == "table absent", timeout=5)
            command(op="resend", workload=workload)
            log.wait(lambda line: _event(line) == "table present")

            # Every "table absent" the daemon logged came from one of the two deletes, never a replace.
            assert sum(_event(line) == "table absent" for line in log.seen) == 2

            # SIGTERM: a clean close, exit 0, the table stays.
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(15) == 0
            closed = gateway_saw("closed", workload=workload)
            assert closed["code"] == 1000
            assert lab.run("wl", ["nft", "list", "table", "inet", "palisade"]).returncode == 0
            status = json.loads(run_cli("status", "--state-dir", state, "--json", netns=ns).stdout)
            assert status["stream"]["state"] == "disconnected"
            assert status["applied"]["version"] == "v2" and status["owned_table"]["state"] == "present"

            # Beyond the grace: the daemon stops with one error line and a non-zero status.
            command(op="refuse", workload=workload, code=4403, reason="credential expired beyond its grace")
            refused = subprocess.run(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "agent", "run", "--state-dir", state],
                capture_output=True, text=True, timeout=60, cwd=REPO, env={"PYTHONPATH": str(REPO)},
            )  # fmt: skip
            assert refused.returncode == 3  # the unit's RestartPreventExitStatus
            errors = [
                line for line in refused.stderr.splitlines() if line.startswith("palisade-agent: error:")
            ]
            assert len(errors) == 1 and "re-enrol" in errors[0] and "Traceback" not in refused.stderr
            assert (
                lab.run("wl", ["nft", "list", "table", "inet", "palisade"]).returncode == 0
            )  # still fail static
        finally:
            if daemon is not None and daemon.poll() is None:
                daemon.kill()
                daemon.wait(10)
            gateway.kill()
            gateway.wait(10)


PROMTOOL = "/usr/bin/promtool"


def _promtool_check(path: Path) -> None:
    """`promtool check metrics`: the exposition parses and follows Prometheus's naming rules."""
    with open(path, "rb") as handle:
        checked = subprocess.run(
            [PROMTOOL, "check", "metrics"], stdin=handle, capture_output=True, timeout=30
        )
    assert checked.returncode == 0, (checked.stdout + checked.stderr).decode() + path.read_text()


def _file_until(path: Path, predicate, process: subprocess.Popen, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        if text and predicate(text):
            return text
        assert process.poll() is None, f"the daemon exited with {process.returncode}"
        assert time.monotonic() < deadline, f"not within {timeout} s; the file holds:\n{text}"
        time.sleep(0.05)


def test_run_writes_the_metrics_textfile_promtool_accepts(tmp_path):
    """The real daemon, real nftables and flow sources, `--metrics-textfile`: the file shows the applied
    version and the table, follows a delete, says the agent stopped at SIGTERM, and passes promtool."""
    require_namespace_lab()
    require(os.path.exists(PROMTOOL), f"{PROMTOOL} is missing: install Debian's prometheus (deploy/test.sh)")
    state = str(tmp_path / "state")
    textfile = tmp_path / "node-exporter" / "palisade-agent.prom"
    textfile.parent.mkdir()
    with Lab.create({"wl": (None, None)}) as lab:
        ns = lab.ns("wl")
        gateway = lab.popen_python("wl", GATEWAY, str(tmp_path / "gateway"))
        daemon = None
        try:
            gateway_out = Lines(gateway.stdout)
            ready = json.loads(gateway_out.wait(lambda line: line.startswith('{"ready"')))
            enrolled = run_cli("enrol", "--bundle", ready["bundle"], "--state-dir", state, netns=ns)
            assert enrolled.returncode == 0, enrolled.stderr
            workload = json.loads((tmp_path / "state" / "identity.json").read_text())["workload_id"]
            gateway.stdin.write(
                json.dumps(
                    {"op": "snapshot", "workload": workload, "version": "v1", "document": document("v1")}
                )
                + "\n"
            )
            gateway.stdin.flush()
            gateway_out.wait(lambda line: json.loads(line).get("kind") == "done")

            daemon = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "agent", "run", "--state-dir", state,
                 "--heartbeat-seconds", "1", "--metrics-textfile", str(textfile)],
                stderr=subprocess.PIPE, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            )  # fmt: skip
            Lines(daemon.stderr)  # keeps the pipe drained

            def ready_and_applied(text: str) -> bool:
                return (
                    metric_value(text, "palisade_agent_applied_version_info", version="v1", mode="enforced")
                    == 1
                    and metric_value(text, "palisade_agent_owned_table", state="present") == 1
                    and metric_value(text, "palisade_agent_stream_connected") == 1
                )

            text = _file_until(textfile, ready_and_applied, daemon)
            assert metric_value(text, "palisade_agent_running") == 1
            assert metric_value(text, "palisade_agent_apply_failures_total") == 0
            for source in ("conntrack", "nflog"):  # the real sources, counted
                assert (
                    metric_value(text, "palisade_agent_flow_source_events_total", source=source) is not None
                )
            _promtool_check(textfile)

            assert lab.run("wl", ["nft", "delete", "table", "inet", "palisade"]).returncode == 0
            _file_until(
                textfile, lambda t: metric_value(t, "palisade_agent_owned_table", state="absent") == 1, daemon
            )

            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(15) == 0
            text = textfile.read_text()
            assert metric_value(text, "palisade_agent_running") == 0
            assert metric_value(text, "palisade_agent_stream_connected") == 0
            assert (
                metric_value(text, "palisade_agent_applied_version_info", version="v1", mode="enforced") == 1
            )
            _promtool_check(textfile)
            assert sorted(p.name for p in textfile.parent.iterdir()) == ["palisade-agent.prom"]
        finally:
            if daemon is not None and daemon.poll() is None:
                daemon.kill()
                daemon.wait(10)
            gateway.kill()
            gateway.wait(10)

"""Thousands of simulated agents on the real serve, and what a test or a benchmark watches meanwhile.

    with simulated_agents(serve, operator, root, count=2000) as fleet:   # enrolled, connected, synced
        probe = Probe(serve, token, fleet.agent_dir(1)); probe.start()    # GET /me and flow reports
        ...
        probe.stop.set(); probe.join(); probe.figures()

The agents are `python -m agent simulate` (the real agent code with a dataplane that records documents,
all in one process, on loopback). serve must admit them all from 127.0.0.1: start it with
`--max-connections-per-address 0`.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agent.flowreport import report_body
from agent.protocol import FLOWS_PATH
from agent.state import StateDir
from tests.support.serve_process import REPO, terminate


@dataclass
class Fleet:
    simulator: subprocess.Popen
    root: Path
    log: Path
    count: int

    def agent_dir(self, index: int) -> Path:
        return self.root / f"sim-{index:05d}"

    def last_summary(self) -> str:
        """The simulator's latest count of its agents by stream state (it logs one every 10 s)."""
        lines = [line for line in self.log.read_text().splitlines() if "[fleet] fleet " in line]
        return lines[-1].split("[fleet] fleet ", 1)[1] if lines else "none yet"


def counts(operator) -> dict:
    return operator.get("/api/v1/workloads/counts").json()


def snapshots_sent(operator) -> dict[str, str]:
    """Each workload's `sync.last_snapshot_sent_at`: it moves when its agent opens a new stream."""
    sent, cursor = {}, None
    while True:
        page = operator.get(
            "/api/v1/workloads", params={"limit": 500, **({"cursor": cursor} if cursor else {})}
        ).json()
        sent.update({w["id"]: w["sync"]["last_snapshot_sent_at"] for w in page["items"]})
        cursor = page["next_cursor"]
        if not cursor:
            return sent


@contextmanager
def simulated_agents(
    serve, operator, root: Path, *, count: int, heartbeat_seconds: float = 15, timeout: float = 600
):
    """`count` agents enrolled with one provisioning token and connected, until every one is synced."""
    minted = operator.post(
        "/api/v1/provisioning-tokens", json={"description": "simulated", "max_uses": count}
    )
    root.mkdir(parents=True, exist_ok=True)
    bundle = root / "bundle.txt"
    bundle.write_text(minted.json()["bundle"])
    log = root / "simulator.log"
    with log.open("w") as sink:
        simulator = subprocess.Popen(
            [sys.executable, "-m", "agent", "simulate", "--bundle-file", str(bundle), "--count", str(count),
             "--state-root", str(root / "agents"), "--heartbeat-seconds", str(heartbeat_seconds)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=sink,
            env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, start_new_session=True,
        )  # fmt: skip
    fleet = Fleet(simulator, root / "agents", log, count)
    try:
        deadline = time.monotonic() + timeout
        seen: dict = {}
        while (seen := counts(operator))["sync_state"]["synced"] != count:
            if simulator.poll() is not None:
                raise AssertionError(
                    f"the simulator exited {simulator.returncode}: {log.read_text()[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} agents not synced within {timeout} s: {seen}")
            time.sleep(1)
        yield fleet
    finally:
        terminate(simulator)


class FleetReports(threading.Thread):
    """The fleet's flow reports, as its agents send them: each agent one report a minute (an empty one,
    as a process with nothing new still sends), each over a TLS connection of its own, spread evenly.
    `sent` and `failed` count them; a failure is only counted (an agent would retry later)."""

    def __init__(self, serve, fleet: Fleet, *, every_seconds: float = 60.0, threads: int = 8):
        super().__init__(daemon=True)
        from tests.support.serve_process import pinned_context

        self.host, self.port = serve.address("gateway")
        self.context = pinned_context(serve._served.get("gateway") or serve.served_certificate("gateway"))
        self.agents = [StateDir(fleet.agent_dir(i)).load_enrolment() for i in range(1, fleet.count + 1)]
        self.interval = every_seconds / len(self.agents)
        self.threads = threads
        self.sent = self.failed = 0
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        started = time.time()
        with ThreadPoolExecutor(self.threads) as pool:
            turn = 0
            while not self.stop.wait(max(0.0, started + turn * self.interval - time.time())):
                pool.submit(self._send, self.agents[turn % len(self.agents)], time.time() - started + 1)
                turn += 1

    def _send(self, agent, uptime: float) -> None:
        body = report_body(
            [], [], now=time.time(), process_start_id="fleet", uptime_seconds=uptime, window_seconds=60
        )
        connection = http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=60)
        try:
            connection.request("POST", FLOWS_PATH, body=body, headers=agent.flow_report_headers(body))
            ok = connection.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            ok = False
        finally:
            connection.close()
        with self._lock:
            self.sent += ok
            self.failed += not ok


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


class Probe(threading.Thread):
    """`GET /me` with an operator token and an empty flow report of one agent (what a new agent process
    sends first), one after the other every `pause` seconds until `stop` is set: their latencies."""

    def __init__(self, serve, token: str, agent_dir: Path, *, pause: float = 0.2, timeout: float = 120):
        super().__init__(daemon=True)
        self.serve, self.token, self.pause, self.timeout = serve, token, pause, timeout
        self.agent = StateDir(agent_dir).load_enrolment()
        self.me: list[float] = []
        self.reports: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        started = time.time()
        headers = {"Authorization": f"Bearer {self.token}"}
        with (
            self.serve.client("operator", headers=headers, timeout=self.timeout) as operator,
            self.serve.client("gateway", timeout=self.timeout) as gateway,
        ):
            while not self.stop.is_set():
                self._timed(self.me, lambda: operator.get("/api/v1/me"))
                body = report_body(
                    [], [], now=time.time(), process_start_id="probe",
                    uptime_seconds=time.time() - started + 1, window_seconds=60,
                )  # fmt: skip
                headers = self.agent.flow_report_headers(body)
                self._timed(self.reports, lambda: gateway.post(FLOWS_PATH, content=body, headers=headers))
                self.stop.wait(self.pause)

    def _timed(self, into: list[float], call) -> None:
        began = time.monotonic()
        try:
            response = call()
        except Exception as error:  # noqa: BLE001 - a timeout or a reset is what this records
            into.append(time.monotonic() - began)
            self.failures.append(f"{type(error).__name__}: {error}")
            return
        into.append(time.monotonic() - began)
        if response.status_code != 200:
            self.failures.append(f"{response.request.url.path} -> {response.status_code}")

    def figures(self) -> dict:
        def of(values: list[float]) -> dict:
            if not values:
                return {"answered": 0}
            return {
                "answered": len(values),
                "p50_ms": round(percentile(values, 0.5) * 1000, 1),
                "p95_ms": round(percentile(values, 0.95) * 1000, 1),
                "max_ms": round(max(values) * 1000, 1),
            }

        return {"me": of(self.me), "flow_reports": of(self.reports), "failures": len(self.failures),
                "failure_examples": self.failures[:5]}  # fmt: skip

"""PostgreSQL stopped under a running serve, with agents streaming and reporting and an operator
reading, then started again: every answer meanwhile is a 503 problem with Retry-After (never a 500),
serve logs a few lines for the whole outage (no traceback) and says once that the database is back,
and afterwards the agents converge and the flow report held back during the outage is stored once.

The PostgreSQL is the test's own (tests/support/own_postgres.py): stopping the shared one would stop
every other test on the machine.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from agent.enrol import enrol
from agent.flowreport import instant
from agent.flowreporter import FlowReporter, FlowSettings
from agent.flowwindow import FlowKey, Windows
from agent.state import StateDir
from agent.tls import pinned_context
from controlplane.outage import SETTLE_SECONDS
from tests.support.own_postgres import OwnPostgres, unavailable_reason
from tests.support.serve_process import REPO, Site, terminate

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]

AGENTS = 4
OUTAGE_SECONDS = 10
UNAVAILABLE = "urn:service:problem:service-unavailable"


def _simulator(bundle, state_root):
    return subprocess.Popen(
        [sys.executable, "-m", "agent", "simulate", "--bundle-file", str(bundle), "--count", str(AGENTS),
         "--state-root", str(state_root), "--heartbeat-seconds", "1"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, start_new_session=True,
    )  # fmt: skip


def _converged(http) -> bool:
    items = http.get("/api/v1/workloads").json()["items"]
    simulated = [w for w in items if w["hostname"].startswith("sim-")]
    return len(simulated) == AGENTS and all(
        w["sync"]["state"] == "synced" and w["applied_version"] == w["latest_version"] for w in simulated
    )


def _wait(done, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if done():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout} s")


class Reader(threading.Thread):
    """An operator reading the API, and an agent's enrolment on the gateway, in a loop: every answer."""

    def __init__(self, serve, token: str):
        super().__init__(daemon=True)
        self.operator = serve.client("operator", headers={"Authorization": f"Bearer {token}"})
        self.gateway = serve.client("gateway")
        self.answers: list[tuple[str, httpx.Response]] = []
        self.failures: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            for name, call in (
                ("GET /api/v1/workloads", lambda: self.operator.get("/api/v1/workloads")),
                ("GET /api/v1/me", lambda: self.operator.get("/api/v1/me")),
                ("POST /agent/v1/enrol", lambda: self.gateway.post(
                    "/agent/v1/enrol", json={"v": 1, "token": "not-a-token", "public_key": "x"})),
            ):  # fmt: skip
                try:
                    self.answers.append((name, call()))
                except Exception as error:  # noqa: BLE001 - a schema mismatch or a broken answer
                    self.failures.append(f"{name}: {type(error).__name__}: {error}")
            self.stopping.wait(0.1)

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)
        self.operator.close()
        self.gateway.close()


def _reporter(state_dir) -> FlowReporter:
    """The agent's own flow reporter, no sources, one closed window waiting in its buffer."""
    state = StateDir(state_dir)
    pem = state.load_identity().certificate_pem
    reporter = FlowReporter(
        state, settings=FlowSettings(), context=lambda: pinned_context(pem), policy_version=lambda: "v",
        table_absent=lambda: False, process_start_id="outage", log=lambda *a, **k: None, sources={},
        accounting=False,
    )  # fmt: skip
    t0 = math.floor(time.time() / 60) * 60 - 180
    windows = Windows(length=60, max_keys=100, accounting=False)
    windows.connection_opened(FlowKey("10.60.0.2", "tcp", 443, "allowed", 1), t0 + 1)
    closed, gaps = windows.close_due(math.inf, "v")
    reporter.buffer.add(closed, gaps)
    return reporter


def test_a_database_outage_is_503s_a_few_log_lines_and_nothing_lost(tmp_path):
    with OwnPostgres.started() as postgres:
        site = Site(tmp_path / "data", postgres.database("palisade"))
        serve = site.serve(env={"REDIS_URL": ""})
        simulator = None
        reader = None
        try:
            token = serve.mint_operator_token()
            http = serve.client("operator", headers={"Authorization": f"Bearer {token}"})
            bundle = http.post(
                "/api/v1/provisioning-tokens", json={"description": "outage", "max_uses": AGENTS + 1}
            ).json()["bundle"]
            (tmp_path / "bundle.txt").write_text(bundle)
            enrol(bundle, str(tmp_path / "reporter"), hostname="reporter", addresses=["10.60.0.1"])
            reporter = _reporter(tmp_path / "reporter")
            ((window_id, *_),) = [(w["id"],) for w in reporter.buffer.pending()[0]]
            simulator = _simulator(tmp_path / "bundle.txt", tmp_path / "agents")
            _wait(lambda: _converged(http), 60, "the simulated agents converged")
            reader = Reader(serve, token)
            reader.start()
            time.sleep(1)

            outage_from = len(serve.stderr_text().splitlines())
            postgres.stop()
            # The agents' streams start again while the database is away: they authenticate in vain.
            terminate(simulator)
            simulator = _simulator(tmp_path / "bundle.txt", tmp_path / "agents")
            refused = reporter.send_pending()
            held_back = reporter.buffer.pending()[0]
            retry_after = reporter.retry_after
            time.sleep(OUTAGE_SECONDS)
            postgres.start()

            serve.wait_for_stderr(r"database available again", timeout=30)
            since = serve.stderr_text().splitlines()[outage_from:]
            outage_lines = since[: next(i for i, line in enumerate(since) if "available again" in line) + 1]
            _wait(lambda: _converged(http), 60, "the simulated agents converged again")
            # Later, a change every stream acknowledges: no database thread of the gateway fails on a
            # connection the server dropped (nor calls it a new outage).
            time.sleep(SETTLE_SECONDS + 1)
            changed = http.post(
                "/api/v1/mode-changes", json={"selection": {"all": True}, "mode": "simulation"}
            )
            assert changed.status_code in (200, 201, 202), changed.text
            _wait(lambda: _converged(http), 30, "the simulated agents applied the change")
            for _ in range(20):
                if reporter.send_pending():
                    break
                time.sleep(1)
            reader.stop()
            stored = http.get(
                "/api/v1/flows",
                params={"workload": reporter.state.load_identity().workload_id,
                        "from": instant(time.time() - 3600), "to": instant(time.time() + 60)},
            ).json()["items"]  # fmt: skip
            http.close()
        finally:
            if reader is not None:
                reader.stopping.set()
            if simulator is not None:
                terminate(simulator)
            assert serve.stop() == 0
        log = serve.stderr_text()

    assert not reader.failures, reader.failures[:5]
    statuses = {(name, response.status_code) for name, response in reader.answers}
    unexpected = [
        (name, response.status_code, response.text[:200])
        for name, response in reader.answers
        if response.status_code >= 500 and response.status_code != 503
    ]
    assert not unexpected, unexpected
    unavailable = [response for _, response in reader.answers if response.status_code == 503]
    assert {name for name, status in statuses if status == 503} == {
        "GET /api/v1/workloads", "GET /api/v1/me", "POST /agent/v1/enrol"
    }, statuses  # fmt: skip
    for response in unavailable:
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["type"] == UNAVAILABLE
        assert 5 <= int(response.headers["retry-after"]) <= 15
        assert response.json()["retry_after"] == int(response.headers["retry-after"])

    assert "Traceback" not in log
    assert len([line for line in log.splitlines() if "database unavailable: cannot serve" in line]) <= 1, log
    assert len(outage_lines) < 30, "\n".join(outage_lines)
    assert len([line for line in log.splitlines() if "database available again" in line]) == 1, log

    assert refused is False and 5 <= retry_after <= 15
    assert [w["id"] for w in held_back] == [window_id]  # kept in the buffer
    assert [w["id"] for w in stored] == [window_id]  # stored once

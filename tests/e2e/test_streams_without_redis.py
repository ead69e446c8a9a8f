"""Two `serve` processes on one database and one Redis of the test's own, simulated agents on both;
Redis is stopped and started again under them. Streams do not depend on the channel layer: they stay
up, agents reconnect, the fleet's states tell the truth, and a change made while Redis is away reaches
every agent through the database-driven catch-up sweep. Redis goes away killed (connections refused)
and paused (SIGSTOP: connections accepted, nothing answered)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.requirements import require
from tests.support.serve_process import REPO, Site, free_port, terminate

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

AGENTS_EACH = 4
# Generous bounds that still tell "promptly" from "never" (the sweep runs every 2 s, heartbeats every 1 s).
PROMPTLY = 20.0


class RedisServer:
    """A redis-server of the test's own on a free loopback port, stopped and started at will."""

    def __init__(self, port: int):
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        import redis

        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis.from_url(self.url, socket_connect_timeout=0.5).ping():
                    return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"redis-server did not answer on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)  # a paused one too
            self.process.kill()
            self.process.wait(10)
            self.process = None

    def go_away(self, how: str) -> None:
        if how == "paused":
            self.process.send_signal(signal.SIGSTOP)
        else:
            self.stop()

    def come_back(self, how: str) -> None:
        if how == "paused":
            self.process.send_signal(signal.SIGCONT)
        else:
            self.start()


@pytest.fixture
def redis_server():
    require(shutil.which("redis-server") is not None, "needs redis-server (apt install redis-server)")
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()


def simulate(bundle: str, root: Path, first_index: int) -> subprocess.Popen:
    # Each fleet numbers its agents apart: an agent's number is its address, held by one workload.
    (root / "bundle.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "bundle.txt").write_text(bundle)
    return subprocess.Popen(
        [sys.executable, "-m", "agent", "simulate", "--bundle-file", str(root / "bundle.txt"),
         "--count", str(AGENTS_EACH), "--first-index", str(first_index), "--state-root", str(root / "agents"), "--heartbeat-seconds", "1"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, start_new_session=True,
    )  # fmt: skip


def in_sync(workload: dict) -> bool:
    return workload["sync"]["state"] == "synced" and workload["applied_version"] == workload["latest_version"]


def workloads(http) -> list[dict]:
    response = http.get("/api/v1/workloads")
    assert response.status_code == 200, response.text
    return response.json()["items"]


def wait_for(http, done, timeout: float = PROMPTLY, what: str = "") -> list[dict]:
    end = time.monotonic() + timeout
    items: list[dict] = []
    while time.monotonic() < end:
        items = workloads(http)
        if done(items):
            return items
        time.sleep(0.2)
    raise AssertionError(
        f"{what} not reached within {timeout} s: {[(w['hostname'], w['mode'], w['sync']['state']) for w in items]}"
    )


def counts(http) -> dict:
    response = http.get("/api/v1/workloads/counts")
    assert response.status_code == 200, response.text
    return response.json()


def change_mode(http, mode: str) -> None:
    response = http.post("/api/v1/mode-changes", json={"selection": {"all": True}, "mode": mode})
    assert response.status_code in (200, 201, 202), response.text


def all_in(mode: str, total: int):
    return lambda items: len(items) == total and all(w["mode"] == mode and in_sync(w) for w in items)


@pytest.mark.parametrize("outage", ["killed", "paused"])
def test_streams_survive_redis_stopped_and_restarted_under_two_serve_processes(
    redis_server, tmp_path, outage
):
    require(
        os.environ.get("DATABASE_URL", "").startswith("postgres"),
        "needs PostgreSQL shared by two serve processes: set DATABASE_URL=postgresql://...",
    )
    simulators: list[subprocess.Popen] = []
    with Site.fresh(tmp_path / "data", migrated=True) as site:
        env = {"REDIS_URL": redis_server.url}
        first, second = site.serve(env=env), site.serve(env=env)
        token = first.mint_operator_token()
        apis = [
            serve.client("operator", headers={"Authorization": f"Bearer {token}"})
            for serve in (first, second)
        ]
        try:
            fleets = {}
            for name, api in zip(("first", "second"), apis, strict=True):
                minted = api.post(
                    "/api/v1/provisioning-tokens", json={"description": name, "max_uses": AGENTS_EACH}
                )
                assert minted.status_code == 201, minted.text
                fleets[name] = minted.json()["bundle"]  # names the gateway of the process that minted it
            simulators = [simulate(fleets["first"], tmp_path / "first", 1)]
            wait_for(apis[0], all_in("visibility", AGENTS_EACH), 60, "the first fleet synced")
            simulators.append(simulate(fleets["second"], tmp_path / "second", 1 + AGENTS_EACH))
            total = 2 * AGENTS_EACH
            wait_for(apis[0], all_in("visibility", total), 60, "both fleets synced")

            # -- with Redis up, a change made through one process reaches the agents of both --
            change_mode(apis[1], "simulation")
            wait_for(apis[0], all_in("simulation", total), what="the change with Redis up")

            # -- Redis stops: the streams stay up and a change still reaches every agent --
            redis_server.go_away(outage)
            time.sleep(3)  # long enough for every stream's layer receive to have failed
            assert counts(apis[0])["sync_state"]["synced"] == total, counts(apis[0])
            change_mode(apis[0], "enforced")
            wait_for(apis[1], all_in("enforced", total), what="the change with Redis down")

            # -- agents that go away are recorded offline, and reconnect without Redis --
            terminate(simulators.pop())
            wait_for(
                apis[0],
                lambda items: sum(w["sync"]["state"] == "offline" for w in items) == AGENTS_EACH,
                what="the stopped agents recorded offline",
            )
            assert counts(apis[1])["sync_state"] == {"synced": AGENTS_EACH, "offline": AGENTS_EACH} | {
                state: 0 for state in counts(apis[1])["sync_state"] if state not in ("synced", "offline")
            }
            simulators.append(simulate(fleets["second"], tmp_path / "second", 1 + AGENTS_EACH))
            wait_for(apis[0], all_in("enforced", total), what="the agents reconnected without Redis")

            # -- Redis is back: notifications travel again --
            redis_server.come_back(outage)
            time.sleep(3)
            change_mode(apis[1], "visibility")
            wait_for(apis[0], all_in("visibility", total), what="the change once Redis is back")
            assert counts(apis[0])["sync_state"]["synced"] == total

            # -- the agents go: every stream is recorded offline; both processes stop cleanly --
            while simulators:
                terminate(simulators.pop())
            wait_for(
                apis[1],
                lambda items: all(w["sync"]["state"] == "offline" for w in items),
                what="every agent recorded offline",
            )
            assert counts(apis[0])["sync_state"]["offline"] == total
            assert first.stop() == 0 and second.stop() == 0
            for serve in (first, second):
                log = serve.stderr_text()
                for wrong in (
                    "Exception inside application",
                    "no auth within the handshake time",
                    "Traceback",
                    "Task was destroyed",
                ):
                    assert wrong not in log, log
        except BaseException:
            for name, serve in (("first", first), ("second", second)):
                print(f"--- serve {name} ---\n{serve.stderr_text()[-6000:]}")
            raise
        finally:
            for simulator in simulators:
                terminate(simulator)
            for api in apis:
                api.close()

"""Fail over between gateways end to end: two `serve` processes of one control plane (PostgreSQL and
Redis of the test's own) in the control plane's namespace, two real agents in namespaces of their own
and a fleet of simulated agents, every bundle listing both gateways. The process most agents stream to
is SIGKILLed: every agent streams again on the other within 15 s, a mode change made right after
reaches all of them, and the real agents' flow windows across the kill are stored exactly once, their
counts equal to the connections made. Then the other process is killed too: the agents keep their
tables and buffer their windows, and report them once a gateway is back.

PALISADE_FAILOVER_AGENTS sets the simulated fleet (default 300)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from tests.support.lab import TCP_SERVER, AgentProcess, NamespacedServe, probe, via_unix_socket
from tests.support.netns import REPO, Lab, require_namespace_lab
from tests.support.requirements import require
from tests.support.serve_process import throwaway_database

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.root,
    pytest.mark.postgres,
    pytest.mark.timeout(600),
    pytest.mark.alone,
]

CP, WEB, CLIENT = "10.91.0.1", "10.91.0.11", "10.91.0.12"
PORTS = {f"{CP}:8443": 8080, f"{CP}:9443": 9080}  # gateway -> its process's operator port
GATEWAYS = list(PORTS)
REDIS_PORT = 6391
SIMULATED = int(os.environ.get("PALISADE_FAILOVER_AGENTS", "300"))
FAILOVER_SECONDS = 15.0
PROBES = 3  # connections to port 8080 from each real agent's host to the other's, in each phase


@pytest.fixture
def lab():
    require_namespace_lab()
    require(shutil.which("redis-server") is not None, "needs redis-server (apt install redis-server)")
    require(
        os.environ.get("DATABASE_URL", "").startswith("postgres"),
        "needs PostgreSQL shared by two serve processes: set DATABASE_URL=postgresql://...",
    )
    with Lab.create({"cp": (CP, None), "web": (WEB, None), "client": (CLIENT, None)}) as lab:
        servers = [lab.popen_python(ns, TCP_SERVER, "8080") for ns in ("web", "client")]
        for process in servers:
            assert process.stdout.readline().strip() == "ready"
        redis = subprocess.Popen(
            ["ip", "netns", "exec", lab.ns("cp"), "redis-server", "--bind", "127.0.0.1",
             "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            yield lab
        finally:
            for process in (redis, *servers):
                process.kill()
                process.wait(10)


class Fleet:
    """What the database says about every workload's stream: read straight, a few hundred at a time."""

    def __init__(self, database_url: str):
        import psycopg

        self.db = psycopg.connect(database_url, autocommit=True)

    def streams(self) -> Counter:
        """Gateway -> workloads with an open stream on it."""
        rows = self.db.execute(
            "SELECT stream_gateway, count(*) FROM fleet_workload WHERE stream_id <> '' GROUP BY 1"
        ).fetchall()
        return Counter(dict(rows))

    def converged(self, mode: str) -> int:
        """Workloads streaming, in `mode`, that applied their latest version."""
        return self.db.execute(
            "SELECT count(*) FROM fleet_workload WHERE stream_id <> '' AND mode = %s "
            "AND sync_state = 'synced' AND applied_version = latest_policy_id",
            (mode,),
        ).fetchone()[0]

    def wait(self, what: str, predicate, timeout: float) -> float:
        """Seconds until predicate() holds; fails with `what` after `timeout`."""
        began = time.monotonic()
        while not predicate():
            if time.monotonic() - began > timeout:
                raise AssertionError(f"{what} not within {timeout} s: {self.streams()}")
            time.sleep(0.2)
        return time.monotonic() - began


def _serve(lab, tcp_database_url: str, data_dir, gateway: str, *, wait: bool = True) -> NamespacedServe:
    """One serve process of the control plane, on `gateway` and its operator port. One data directory:
    every process presents its gateway certificate (docs/operations.md). `wait=False`: started, not yet
    listening (call wait_ready())."""
    return NamespacedServe(
        lab,
        "cp",
        data_dir,
        [arg for g in GATEWAYS for arg in ("--gateway-advertise", g)]
        + ["--max-connections-per-address", "0"],  # the simulated fleet shares one address
        database_url=via_unix_socket(tcp_database_url),
        env={"REDIS_URL": f"redis://127.0.0.1:{REDIS_PORT}/0"},
        operator_listen=f"{CP}:{PORTS[gateway]}",
        gateway_listen=gateway,
        migrated=True,
    ).start(wait=wait)


def _both_serves(lab, tcp_database_url: str, data_dir, into: dict) -> None:
    """Both processes, started together (into: gateway -> process, for the test's clean-up): on a
    migrated database neither waits for the other, and their start-ups overlap instead of adding up."""
    for gateway in GATEWAYS:
        into[gateway] = _serve(lab, tcp_database_url, data_dir, gateway, wait=False)
    for gateway in GATEWAYS:
        into[gateway].wait_ready()


def _instant(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def _traffic(lab) -> None:
    """PROBES connections each way between the real agents' hosts, every one admitted."""
    for _ in range(PROBES):
        assert probe(lab, "client", WEB, 8080) == "open"
        assert probe(lab, "web", CLIENT, 8080) == "open"


def _inbound(api, workload_id: str, peer: str, began: datetime) -> tuple[int, list[str]]:
    """Connections from `peer` to port 8080 one agent reported since `began`, and their windows' ids."""
    params = {
        "workload": workload_id,
        "from": _instant(began),
        "to": _instant(datetime.now(UTC) + timedelta(minutes=1)),
    }
    page = api.get("/flows", params={**params, "limit": 500})
    windows = [w for w in page["items"] if any(g["port"] == 8080 and g["peer"] == peer for g in w["groups"])]
    count = sum(
        g["connection_count"] for w in windows for g in w["groups"] if g["port"] == 8080 and g["peer"] == peer
    )
    return count, [w["id"] for w in windows]


def _gaps(api, workload_id: str, began: datetime) -> list[dict]:
    params = {
        "workload": workload_id,
        "from": _instant(began),
        "to": _instant(datetime.now(UTC) + timedelta(minutes=1)),
    }
    return api.get("/flows/gaps", params=params)["items"]


def _status(agent: AgentProcess) -> dict:
    done = agent.cli("status", "--json", "--state-dir", str(agent.state_dir))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_agents_fail_over_to_the_other_gateway_and_lose_or_repeat_no_window(lab, tmp_path):
    agents: list[AgentProcess] = []
    simulator: subprocess.Popen | None = None
    serves: dict[str, NamespacedServe] = {}
    total = SIMULATED + 2
    with throwaway_database(migrated=True) as tcp_database_url:
        fleet = Fleet(tcp_database_url)
        data_dir = tmp_path / "cp"

        def serve(gateway: str) -> NamespacedServe:
            serves[gateway] = _serve(lab, tcp_database_url, data_dir, gateway)
            return serves[gateway]

        try:
            _both_serves(lab, tcp_database_url, data_dir, serves)
            token = serves[GATEWAYS[0]].mint_operator_token("e2e")
            apis = {gateway: process.api(token) for gateway, process in serves.items()}
            minted = apis[GATEWAYS[0]].post(
                "/provisioning-tokens", {"description": "failover", "max_uses": total}
            )
            assert minted.status_code == 201, minted.text
            bundle = minted.json()["bundle"]
            assert bundle.startswith("palisade-enrol-v2:")
            # The simulated fleet enrols and connects while the real agents do (one waits for none).
            (tmp_path / "bundle.txt").write_text(bundle)
            simulator = subprocess.Popen(
                ["ip", "netns", "exec", lab.ns("cp"), sys.executable, "-m", "agent", "simulate",
                 "--bundle-file", str(tmp_path / "bundle.txt"), "--count", str(SIMULATED),
                 "--state-root", str(tmp_path / "simulated")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, start_new_session=True,
            )  # fmt: skip

            web, client = (
                AgentProcess(lab, "web", tmp_path / "web"),
                AgentProcess(lab, "client", tmp_path / "client"),
            )
            agents += [web, client]
            ids = {web: web.enrol(bundle, WEB), client: client.enrol(bundle, CLIENT)}
            peers = {web: CLIENT, client: WEB}
            for agent in agents:
                assert json.loads((agent.state_dir / "gateways.json").read_text())["gateways"] == GATEWAYS
                agent.start("--flow-window-seconds", "2")
            fleet.wait("every agent synced", lambda: fleet.converged("visibility") == total, 240)
            # The first gateway that answers is the first of the list.
            assert fleet.streams() == {GATEWAYS[0]: total}, fleet.streams()
            api = apis[GATEWAYS[0]]
            assert api.workload(ids[web])["sync"]["gateway"] == GATEWAYS[0]
            assert _status(web)["stream"] == {
                **_status(web)["stream"],
                "state": "connected",
                "gateway": GATEWAYS[0],
            }
            began = datetime.now(UTC) - timedelta(seconds=5)
            _traffic(lab)

            # -- the process most agents stream to is killed --
            doomed = fleet.streams().most_common(1)[0][0]
            (survivor,) = [g for g in GATEWAYS if g != doomed]
            serves[doomed].stop(signal.SIGKILL)
            killed_at = time.monotonic()
            _traffic(lab)  # while the agents fail over
            fleet.wait(
                "every agent streaming on the other gateway",
                lambda: fleet.streams() == {survivor: total},
                FAILOVER_SECONDS - (time.monotonic() - killed_at),
            )
            failover = time.monotonic() - killed_at
            api = apis[survivor]
            change = api.post("/mode-changes", {"selection": {"all": True}, "mode": "simulation"})
            assert change.status_code == 202, change.text
            converged = fleet.wait(
                "the mode change everywhere", lambda: fleet.converged("simulation") == total, 60
            )
            print(f"{total} agents streaming on {survivor} {failover:.1f} s after the kill; "
                  f"a mode change reached all in {converged:.1f} s")  # fmt: skip
            assert api.workload(ids[client])["sync"]["gateway"] == survivor
            _traffic(lab)

            seen: list = []

            def reported(expected: int):
                counts = {agent: _inbound(api, ids[agent], peers[agent], began) for agent in agents}
                seen[:] = [{agent.ns: count for agent, (count, _) in counts.items()}]
                return all(count == expected for count, _ in counts.values()) and counts

            counts = api.wait_for(
                f"{3 * PROBES} connections from each agent", lambda: reported(3 * PROBES), 60
            )
            for _, windows in counts.values():
                assert len(windows) == len(set(windows))
            for agent in agents:  # nothing is said lost that was not
                assert _gaps(api, ids[agent], began) == []

            # -- every gateway gone: the tables stay, the windows wait in the buffer --
            serves[survivor].stop(signal.SIGKILL)
            _traffic(lab)
            assert lab.run("web", ["nft", "list", "table", "inet", "palisade"]).returncode == 0
            api.wait_for(
                "windows buffered while no gateway answers",
                lambda: all(((_status(a).get("flows") or {}).get("buffer") or {}).get("windows", 0) >= 1 for a in agents),
                30,
            )  # fmt: skip
            assert all(_status(a)["stream"]["state"] != "connected" for a in agents)

            # -- one comes back: every agent streams to it and reports what it kept --
            back = serve(GATEWAYS[0])
            api = back.api(token)
            fleet.wait("every agent back", lambda: fleet.streams() == {GATEWAYS[0]: total}, 90)
            counts = api.wait_for(
                f"{4 * PROBES} connections from each agent", lambda: reported(4 * PROBES), 90
            )
            for _, windows in counts.values():
                assert len(windows) == len(set(windows))
            assert _status(web)["stream"]["gateway"] == GATEWAYS[0]
            for agent in agents:  # the windows kept while no gateway answered were not lost either
                assert _gaps(api, ids[agent], began) == []
        except BaseException:
            print(f"last counts: {seen if 'seen' in locals() else None}")
            raise
        finally:
            if simulator is not None:
                simulator.send_signal(signal.SIGTERM)
                try:
                    simulator.wait(30)
                except subprocess.TimeoutExpired:
                    simulator.kill()
            for agent in agents:
                agent.kill(signal.SIGTERM)
            for process in serves.values():
                process.kill()
            fleet.db.close()
            print("\n".join(f"--- {a.ns} agent log\n{a.log()[-6000:]}" for a in agents))
            for gateway, process in serves.items():
                print(f"--- serve {gateway}\n{process.stderr_text()[-6000:]}")


SILENCE_SECONDS = 10.0
# Every packet to and from the first gateway's port dropped in the control plane's namespace: its process
# runs on, but its host says nothing more, as after a power cut or a partition (no FIN, no RST).
_SILENCE = """
table inet lab_silence {
    chain input { type filter hook input priority -300; tcp dport 8443 drop; }
    chain output { type filter hook output priority -300; tcp sport 8443 drop; }
}
"""


def test_an_agent_leaves_a_gateway_that_went_silent_within_10_s(lab, tmp_path):
    serves: dict[str, NamespacedServe] = {}
    web: AgentProcess | None = None
    with throwaway_database(migrated=True) as tcp_database_url:
        fleet = Fleet(tcp_database_url)
        try:
            _both_serves(lab, tcp_database_url, tmp_path / "cp", serves)
            token = serves[GATEWAYS[0]].mint_operator_token("e2e")
            api = serves[GATEWAYS[1]].api(token)
            minted = api.post("/provisioning-tokens", {"description": "silence", "max_uses": 1})
            assert minted.status_code == 201, minted.text
            web = AgentProcess(lab, "web", tmp_path / "web")
            workload_id = web.enrol(minted.json()["bundle"], WEB)
            web.start()
            fleet.wait("the agent streaming", lambda: fleet.streams() == {GATEWAYS[0]: 1}, 60)

            done = lab.run("cp", ["nft", "-f", "-"], input=_SILENCE, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            silent_since = time.monotonic()
            fleet.wait(
                "the agent streaming on the other gateway",
                lambda: fleet.streams().get(GATEWAYS[1]) == 1,
                SILENCE_SECONDS,
            )
            print(f"streaming on {GATEWAYS[1]} {time.monotonic() - silent_since:.1f} s after the silence")
            assert _status(web)["stream"]["gateway"] == GATEWAYS[1]
            assert api.workload(workload_id)["sync"]["gateway"] == GATEWAYS[1]
        finally:
            for process in serves.values():
                process.kill()
            if web is not None:
                web.kill()
            fleet.db.close()

"""The agent daemon against the real control plane: `manage.py serve` over TLS on loopback, the
operator API to act and observe, and one real `Agent` whose dataplane records documents instead of
calling the kernel (tests/e2e does the same with nftables in namespaces, as root).

The stand-in gateway of test_daemon.py stays for what a correct server never does on its own
(malformed frames, arbitrary close codes, renewals that do not verify); everything a real server
does is checked here, against the real one.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.credential import public_key_encode
from agent.daemon import Agent, CredentialRevoked
from agent.enrol import enrol
from agent.errors import AgentError
from agent.eventlog import EventLog
from agent.simulated import RecordingDataplane
from agent.state import StateDir
from agent.worker import DataplaneWorker
from tests.support.agent_helpers import as_sent
from tests.support.serve_process import Site

pytestmark = pytest.mark.e2e

REFUSAL = "Error: Could not process rule: No such file or directory"


class RunningAgent:
    """One enrolled agent running on its own event loop in a thread, so the test can block on HTTP."""

    def __init__(self, bundle: str, state_dir: Path) -> None:
        enrol(bundle, str(state_dir), hostname="web-1", addresses=["10.0.0.5"])
        self.dataplane = RecordingDataplane()
        self.logs = io.StringIO()
        self.agent = Agent(
            StateDir(str(state_dir)), DataplaneWorker.inline(self.dataplane), heartbeat_seconds=0.5,
            log=EventLog(stream=self.logs),
        )  # fmt: skip
        self.loop = asyncio.new_event_loop()
        self.error: Exception | None = None  # what stopped the daemon by itself (e.g. 4410)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self.agent.run())
        except Exception as error:  # noqa: BLE001 - kept for the test to assert on
            self.error = error

    def call(self, function, *args):
        """Run `function` on the agent's loop (the dataplane and the agent are not thread-safe)."""
        done = threading.Event()
        result: list = []

        def run():
            result.append(function(*args))
            done.set()

        self.loop.call_soon_threadsafe(run)
        assert done.wait(10)
        return result[0]

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.agent.stop, "test")
        self.thread.join(20)
        self.loop.close()

    def log_lines(self) -> list[str]:
        return [line.split(" ", 1)[1] for line in self.logs.getvalue().splitlines()]


@pytest.fixture
def world(tmp_path):
    with Site.fresh(tmp_path / "data", migrated=True) as site:
        serve = site.serve()
        http = serve.client("operator", headers={"Authorization": f"Bearer {serve.mint_operator_token()}"})
        bundle = http.post(
            "/api/v1/provisioning-tokens", json={"description": "daemon", "max_uses": 1}
        ).json()["bundle"]
        agent = RunningAgent(bundle, tmp_path / "state")
        agent.state_dir = tmp_path / "state"
        try:
            workload = wait(http, lambda w: in_sync(w), "first sync")
            yield site, serve, http, agent, workload
        finally:
            agent.stop()
            http.close()


def the_workload(http) -> dict:
    items = http.get("/api/v1/workloads").json()["items"]
    assert len(items) == 1, items
    return items[0]


def wait(http, done, what: str, timeout: float = 20) -> dict:
    end = time.monotonic() + timeout
    workload: dict = {}
    while time.monotonic() < end:
        try:
            workload = the_workload(http)
        except Exception:  # noqa: BLE001 - serve restarting: keep polling until the deadline
            workload = {}
        if workload and done(workload):
            return workload
        time.sleep(0.1)
    raise AssertionError(f"{what}: not reached within {timeout} s; last seen {workload}")


def in_sync(workload: dict) -> bool:
    return workload["sync"]["state"] == "synced" and workload["applied_version"] == workload["latest_version"]


def rendered(http, workload: dict) -> str:
    return http.get(f"/api/v1/workloads/{workload['id']}/rendered-policy").json()["document"]


def test_the_agent_applies_exactly_the_rendered_document_and_follows_a_mode_change(world):
    _, _, http, agent, workload = world
    assert workload["mode"] == "visibility" and workload["hostname"] == "web-1"
    assert as_sent(agent.dataplane.current) == rendered(http, workload)

    http.post(
        "/api/v1/mode-changes", json={"selection": {"workload_ids": [workload["id"]]}, "mode": "enforced"}
    )
    after = wait(http, lambda w: w["mode"] == "enforced" and in_sync(w), "enforced and synced")
    assert after["latest_version"] != workload["latest_version"]
    assert as_sent(agent.dataplane.current) == rendered(http, after)
    assert f"applied version={after['latest_version']} mode=enforced" in agent.log_lines()


def test_a_refused_document_degrades_the_workload_keeps_the_table_and_a_resend_recovers(world):
    _, _, http, agent, workload = world
    kept = agent.dataplane.current
    agent.call(setattr, agent.dataplane, "fail_with", REFUSAL)
    http.post(
        "/api/v1/mode-changes", json={"selection": {"workload_ids": [workload["id"]]}, "mode": "simulation"}
    )
    degraded = wait(http, lambda w: w["sync"]["state"] == "degraded", "degraded")
    assert REFUSAL in degraded["sync"]["error"]
    assert degraded["applied_version"] == workload["latest_version"] != degraded["latest_version"]
    assert agent.dataplane.current == kept  # the previous table stays
    assert http.get("/api/v1/workloads").json()["items"][0]["id"] == workload["id"]  # first in fleet order

    agent.call(setattr, agent.dataplane, "fail_with", None)
    assert http.post(f"/api/v1/workloads/{workload['id']}/resend-snapshot").status_code == 200
    recovered = wait(http, in_sync, "synced after the resend")
    assert recovered["mode"] == "simulation" and as_sent(agent.dataplane.current) == rendered(http, recovered)


def test_a_table_deleted_on_the_host_shows_absent_and_only_a_resend_restores_it(world):
    _, _, http, agent, workload = world
    agent.call(agent.dataplane.remove)
    absent = wait(http, lambda w: w["health"]["owned_table"]["state"] == "absent", "owned table absent")
    counts = http.get("/api/v1/workloads/counts").json()
    assert counts["removed"] == 1 and counts["sync_state"]["synced"] == 0
    assert http.get("/api/v1/workloads?removed=true").json()["items"][0]["id"] == absent["id"]
    time.sleep(1.5)  # three heartbeats: the agent must not restore the table by itself
    assert agent.call(agent.dataplane.table_present) is False

    assert http.post(f"/api/v1/workloads/{workload['id']}/resend-snapshot").status_code == 200
    restored = wait(
        http, lambda w: w["health"]["owned_table"]["state"] == "present" and in_sync(w), "restored"
    )
    assert as_sent(agent.dataplane.current) == rendered(http, restored)
    assert http.get("/api/v1/workloads/counts").json()["removed"] == 0


def test_the_table_stays_while_serve_is_down_and_the_agent_comes_back_by_itself(world):
    site, serve, http, agent, workload = world
    applies = agent.dataplane.applies
    document = agent.dataplane.current
    assert serve.stop() == 0
    time.sleep(2)
    assert agent.dataplane.current == document  # fail static
    assert any(
        line.startswith("stream disconnected") or line.startswith("backoff") for line in agent.log_lines()
    )

    again = site.serve(operator_listen=serve.operator_listen, gateway_listen=serve.gateway_listen)
    http.close()
    with again.client(
        "operator", headers={"Authorization": f"Bearer {again.mint_operator_token()}"}
    ) as http_again:
        back = wait(http_again, in_sync, "synced after serve came back", timeout=60)
    assert back["latest_version"] == workload["latest_version"]
    assert (
        agent.dataplane.current == document and agent.dataplane.applies == applies
    )  # same version: not reapplied


def test_the_agent_rotates_its_key_a_revocation_stops_it_and_only_a_token_for_it_brings_it_back(world):
    _, serve, http, agent, workload = world
    state_dir = str(agent.state_dir)
    # A hostile host with any general token and the victim's id gets nothing, over the real listener.
    general_token = http.post("/api/v1/provisioning-tokens", json={"description": "sandbox"}).json()["token"]
    with serve.client("gateway") as gateway:
        refused = gateway.post(
            "/agent/v1/enrol",
            json={
                "v": 1, "token": general_token, "workload_id": workload["id"], "hostname": "evil",
                "addresses": ["10.6.6.6"], "agent_version": "0.1.0",
                "public_key": public_key_encode(Ed25519PrivateKey.generate().public_key()),
            },
        )  # fmt: skip
    assert refused.status_code == 403 and refused.json()["type"].endswith(":enrolment-refused")
    assert the_workload(http)["addresses"] == ["10.0.0.5"]
    old_key = public_key_encode(StateDir(state_dir).load_key().public_key())
    # The agent rotating its own key: signed with the current one, no bundle, no token.
    enrol(None, state_dir, hostname="web-1", addresses=["10.0.0.5"], reenrol=True)
    assert public_key_encode(StateDir(state_dir).load_key().public_key()) != old_key
    wait(
        http, lambda w: in_sync(w) and w["enrolled_at"] != workload["enrolled_at"], "synced under the new key"
    )
    events = http.get("/api/v1/audit-events", params={"object_id": workload["id"]}).json()["items"]
    assert events[0]["action"] == "workload.re_enrol" and events[0]["detail"]["via"] == "key"
    assert events[0]["actor"]["kind"] == "agent"

    response = http.post(f"/api/v1/workloads/{workload['id']}/revoke-credential", json={"reason": "stolen"})
    assert response.status_code == 200, response.text
    agent.thread.join(15)
    assert not agent.thread.is_alive() and isinstance(agent.error, CredentialRevoked)
    assert "stream closed code=4410" in "\n".join(agent.log_lines())
    shown = wait(http, lambda w: w["sync"]["state"] == "offline", "offline after the revocation")
    assert shown["health"]["credential"]["revoked"]["reason"] == "stolen"

    # The key no longer re-enrols, with or without a general token; a token minted for it does.
    with pytest.raises(AgentError, match="revoked"):
        enrol(None, state_dir, hostname="web-1", addresses=["10.0.0.5"], reenrol=True)
    general = http.post("/api/v1/provisioning-tokens", json={"description": "general"}).json()["bundle"]
    with pytest.raises(AgentError, match="credential-revoked"):
        enrol(general, state_dir, hostname="web-1", addresses=["10.0.0.5"], reenrol=True)
    for_it = http.post(
        "/api/v1/provisioning-tokens", json={"description": "back", "workload_id": workload["id"]}
    ).json()["bundle"]
    enrol(for_it, state_dir, hostname="web-1", addresses=["10.0.0.5"], reenrol=True)
    back = http.get(f"/api/v1/workloads/{workload['id']}").json()
    assert back["health"]["credential"]["revoked"] is None

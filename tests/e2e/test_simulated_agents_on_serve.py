"""The real agent code (its dataplane recording documents instead of calling the kernel) against
the real `serve` over TLS on loopback: what needs no root, and no namespaces, of the sync stream.

Without REDIS_URL the channel layer lives inside serve, so a change made by a host command in
another process cannot notify the streams; serve's catch-up sweep must still deliver it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.support.serve_process import REPO, Site, terminate

pytestmark = pytest.mark.e2e

AGENTS = 3


@pytest.fixture
def fleet(tmp_path):
    """serve without Redis, and AGENTS simulated agents enrolled with one token and synced."""
    with Site.fresh(tmp_path / "data", migrated=True) as site:
        serve = site.serve(env={"REDIS_URL": ""})
        http = serve.client("operator", headers={"Authorization": f"Bearer {serve.mint_operator_token()}"})
        minted = http.post("/api/v1/provisioning-tokens", json={"description": "e2e", "max_uses": AGENTS})
        bundle = tmp_path / "bundle.txt"
        bundle.write_text(minted.json()["bundle"])
        simulator = subprocess.Popen(
            [sys.executable, "-m", "agent", "simulate", "--bundle-file", str(bundle), "--count", str(AGENTS),
             "--state-root", str(tmp_path / "agents"), "--heartbeat-seconds", "1"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, start_new_session=True,
        )  # fmt: skip
        try:
            workloads = wait_for(
                http, lambda items: len(items) == AGENTS and all(in_sync(w) for w in items), 60
            )
            yield site, serve, http, workloads
        finally:
            terminate(simulator)
            http.close()


def in_sync(workload: dict) -> bool:
    return workload["sync"]["state"] == "synced" and workload["applied_version"] == workload["latest_version"]


def wait_for(http, done, timeout: float) -> list[dict]:
    end = time.monotonic() + timeout
    items: list[dict] = []
    while time.monotonic() < end:
        items = http.get("/api/v1/workloads").json()["items"]
        if done(items):
            return items
        time.sleep(0.2)
    raise AssertionError(f"not reached within {timeout} s: {[(w['hostname'], w['sync']) for w in items]}")


def test_a_mode_change_over_the_api_reaches_every_agent(fleet):
    _, _, http, before = fleet
    response = http.post("/api/v1/mode-changes", json={"selection": {"all": True}, "mode": "simulation"})
    assert response.status_code in (200, 201, 202), response.text
    after = wait_for(http, lambda items: all(w["mode"] == "simulation" and in_sync(w) for w in items), 20)
    versions_before = {w["id"]: w["latest_version"] for w in before}
    assert all(w["latest_version"] != versions_before[w["id"]] for w in after)


def test_a_mode_change_by_a_host_command_reaches_agents_without_redis(fleet):
    site, serve, http, before = fleet
    site.manage("mode-change", "simulation", "--all")
    started = time.monotonic()
    after = wait_for(http, lambda items: all(w["mode"] == "simulation" and in_sync(w) for w in items), 20)
    took = time.monotonic() - started
    versions_before = {w["id"]: w["latest_version"] for w in before}
    assert all(w["latest_version"] != versions_before[w["id"]] for w in after)
    serve.wait_for_stderr(rf"caught up {AGENTS} streams whose change notification did not arrive")
    assert took < 10, f"the catch-up sweep took {took:.1f} s"


def test_a_resend_by_a_host_command_reaches_the_agent_without_redis(fleet):
    site, serve, http, before = fleet
    workload = before[0]
    done = site.manage("workload", "resend-snapshot", workload["id"], "--json")
    assert '"directive": "sent"' in done.stdout
    sent_before = workload["sync"]["last_snapshot_sent_at"]
    after = wait_for(
        http,
        lambda items: any(
            w["id"] == workload["id"] and w["sync"]["last_snapshot_sent_at"] != sent_before and in_sync(w)
            for w in items
        ),
        20,
    )
    serve.wait_for_stderr(r"caught up 1 streams whose change notification did not arrive")
    others = {w["id"]: w["sync"]["last_snapshot_sent_at"] for w in after if w["id"] != workload["id"]}
    assert others == {
        w["id"]: w["sync"]["last_snapshot_sent_at"] for w in before if w["id"] != workload["id"]
    }

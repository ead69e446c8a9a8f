"""Simulated agents: the in-memory dataplane, and a small fleet in one process on the real daemon code."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import weakref

import pytest

from agent.dataplane import ApplyError
from agent.simulated import (
    FleetCollector,
    RecordingDataplane,
    StreamTally,
    sim_addresses,
    sim_hostname,
    start_simulated_fleet,
)
from tests.support.agent_helpers import GatewayThread, as_sent, document, run_cli
from tests.support.fake_gateway import FakeGateway


def test_recording_dataplane():
    dataplane = RecordingDataplane(keep=2)
    assert not dataplane.table_present() and dataplane.remove() is False
    for version in ("v1", "v2", "v3"):
        dataplane.apply(document(version))
    assert dataplane.table_present() and dataplane.current == document("v3")
    assert list(dataplane.documents) == [document("v2"), document("v3")] and dataplane.applies == 3
    with pytest.raises(ApplyError, match="exactly one 'table inet palisade"):
        dataplane.apply("flush ruleset")
    dataplane.fail_with = "Error: Could not process rule: No such file or directory"
    with pytest.raises(ApplyError, match="Could not process rule"):
        dataplane.apply(document("v4"))
    assert dataplane.current == document("v3")  # a refused document changes nothing
    assert dataplane.remove() is True and not dataplane.table_present()


def test_the_tally_counts_attempts_and_names_failures_without_their_numbers():
    tally = StreamTally()
    tally("stream connecting", url="wss://127.0.0.1:8443/v1/agent/stream")
    tally("stream connecting", url="wss://127.0.0.1:8444/v1/agent/stream")
    tally("stream error", error="the gateway 127.0.0.1:8443: TLS handshake or upgrade timed out (busy)")
    tally("stream error", error="the gateway 127.0.0.1:8444: TLS handshake or upgrade timed out (busy)")
    tally("stream connected", gateway="127.0.0.1:8444")
    tally("stream closed", code=4503, reason="busy: retry after 3 s")
    tally("applied", version="v1")
    assert dict(tally.counts) == {
        "tries": 2,
        "failed_TLS_handshake_or_upgrade_timed_out_busy": 2,
        "opened": 1,
        "closed_4503": 1,
    }


class _Node:
    """A cycle's member that a weak reference can watch."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def collector_off():
    """The automatic collector off, as in a simulator, and nothing left frozen afterwards."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def test_the_fleet_collects_in_full_once_calm_even_what_was_frozen(collector_off):
    now = [0.0]
    collector = FleetCollector(calm_seconds=30, calm_objects=1_000, storm_objects=10**9, clock=lambda: now[0])
    node = _Node()  # a stream's objects: made, frozen with the fleet, then closed
    gc.freeze()
    gone = weakref.ref(node)
    del node
    made = [[] for _ in range(2_000)]  # noqa: F841 - container objects made since the last collection
    assert collector.tick(calm=True) is None  # calm begins
    now[0] = 29.0
    assert collector.tick(calm=True) is None
    now[0] = 31.0
    assert collector.tick(calm=False) is None  # an agent reconnecting ends the calm
    now[0] = 40.0
    assert collector.tick(calm=True) is None
    assert gone() is not None  # a cycle waits for the calm
    now[0] = 70.0
    assert collector.tick(calm=True) == "full"
    assert gone() is None
    assert gc.get_freeze_count() > 0  # the fleet's objects frozen again
    assert collector.tick(calm=True) is None  # nothing made since


def test_the_fleet_collects_young_objects_in_a_storm(collector_off):
    collector = FleetCollector(calm_seconds=30, calm_objects=1_000, storm_objects=20_000, clock=lambda: 0.0)
    node = _Node()
    gone = weakref.ref(node)
    del node
    assert collector.tick(calm=False) is None
    made = [[] for _ in range(25_000)]  # noqa: F841
    assert collector.tick(calm=False) == "young"
    assert gone() is None
    assert gc.get_count()[0] < 20_000


def test_address_plan():
    assert sim_hostname(1) == "sim-00001"
    assert sim_addresses(1) == ["10.200.0.1", "fd00:200::1"]
    assert sim_addresses(300) == ["10.200.1.44", "fd00:200::12c"]


def test_a_fleet_in_one_process(tmp_path):
    count = 40

    async def main() -> None:
        gateway = await FakeGateway(tmp_path / "gateway").start()
        bundle = gateway.bundle(gateway.add_token(uses=count))
        logs = io.StringIO()
        fleet = await start_simulated_fleet(
            bundle, count, tmp_path / "fleet", heartbeat_seconds=0.5, log_stream=logs
        )
        fleet.start_rate = 1000.0
        assert len(gateway.workloads) == count
        hostnames = sorted(w["hostname"] for w in gateway.workloads.values())
        assert hostnames[0] == "sim-00001" and hostnames[-1] == f"sim-{count:05d}"
        assert len({w["public_key"] for w in gateway.workloads.values()}) == count  # a key each
        contexts = {id(agent._context) for agent in fleet.agents}
        assert len(contexts) == 1  # one pinned context for everyone

        for workload in gateway.workloads:
            await gateway.push_snapshot(workload, "v1", document("v1"))
        runner = asyncio.ensure_future(fleet.run())
        for workload in gateway.workloads:
            await gateway.wait_for(
                lambda e, w=workload: e["kind"] == "message" and e["type"] == "applied" and e["workload"] == w
            )
        assert all(as_sent(d.current) == document("v1") for d in fleet.dataplanes)
        summary = fleet.summary()
        assert summary["applied"] == count and summary["connected"] == count
        assert summary["tries"] == summary["opened"] == count  # a stream each, at the first try

        # A new version for one agent reaches only that agent.
        target = fleet.agents[7].identity.workload_id
        await gateway.push_snapshot(target, "v2", document("v2"))
        await gateway.wait_for(
            lambda e: (
                e["kind"] == "message"
                and e["workload"] == target
                and e["data"] == {"v": 1, "type": "applied", "version": "v2"}
            )
        )
        assert [as_sent(d.current) for d in fleet.dataplanes].count(document("v2")) == 1
        await gateway.wait_for(lambda e: e["kind"] == "message" and e["type"] == "heartbeat")

        fleet.stop()
        await asyncio.wait_for(runner, 30)
        closes = [e["code"] for e in gateway.events if e["kind"] == "closed"]
        assert closes.count(1000) == count
        assert "fleet stopped" in logs.getvalue()
        await gateway.close()

        # A second run reuses the enrolments instead of spending more token uses.
        again = await FakeGateway(tmp_path / "gateway").start()
        again.workloads = gateway.workloads
        fleet2 = await start_simulated_fleet(
            again.bundle(again.add_token(uses=0)), count, tmp_path / "fleet", log_stream=logs
        )
        assert [a.identity.workload_id for a in fleet2.agents] == [
            a.identity.workload_id for a in fleet.agents
        ]
        await again.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_simulate_command(tmp_path):
    gateway = GatewayThread(tmp_path / "gateway")
    try:
        done = run_cli(
            "simulate", "--bundle", gateway.bundle(uses=5), "--count", "5", "--state-root", str(tmp_path / "fleet"),
            "--duration", "2",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert len(gateway.gateway.workloads) == 5
        assert "fleet stopped" in done.stderr and "connected=5" in done.stderr
        status = json.loads(
            run_cli("status", "--state-dir", str(tmp_path / "fleet" / "sim-00003"), "--json").stdout
        )
        assert status["hostname"] == "sim-00003"

        # A second simulator on the same control plane numbers its agents apart (and so their addresses).
        apart = run_cli(
            "simulate", "--bundle", gateway.bundle(uses=2), "--count", "2", "--first-index", "6",
            "--state-root", str(tmp_path / "apart"), "--duration", "1",
        )  # fmt: skip
        assert apart.returncode == 0, apart.stderr
        assert sorted(w["hostname"] for w in gateway.gateway.workloads.values())[-2:] == [
            "sim-00006",
            "sim-00007",
        ]
        assert sorted(w["addresses"][0] for w in gateway.gateway.workloads.values())[-2:] == [
            "10.200.0.6",
            "10.200.0.7",
        ]
        beyond = run_cli(
            "simulate", "--bundle", gateway.bundle(uses=3), "--count", "3", "--first-index", "64999",
            "--state-root", str(tmp_path / "beyond"), "--duration", "1",
        )  # fmt: skip
        assert beyond.returncode == 1 and "numbered 1 to 65000" in beyond.stderr

        refused = run_cli(
            "simulate", "--bundle", gateway.bundle(uses=1), "--count", "3", "--state-root", str(tmp_path / "other"),
            "--duration", "1",
        )  # fmt: skip
        lines = [line for line in refused.stderr.splitlines() if line.startswith("palisade-agent: error:")]
        assert (
            refused.returncode == 1 and len(lines) == 1 and "2 of 3 simulated enrolments failed" in lines[0]
        )
    finally:
        gateway.close()

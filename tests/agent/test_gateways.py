"""Several gateways on the agent's side: the list expanded to addresses, kept in the state directory,
enrolment through the first that answers, a stream that moves to the next when its gateway goes, and a
list the gateway pushes kept without re-enrolling. Against stand-in gateways (tests/support/fake_gateway.py)
sharing one certificate; the real serve processes in tests/e2e/test_gateway_failover_in_namespaces.py."""

from __future__ import annotations

import asyncio
import io
import json
import time

from agent import protocol as p
from agent.daemon import Agent
from agent.enrol import enrol
from agent.eventlog import EventLog
from agent.gateways import Candidate, candidates, needs_resolving, rotated
from agent.simulated import RecordingDataplane
from agent.state import StateDir
from agent.status import collect, render
from agent.worker import DataplaneWorker
from tests.support.fake_gateway import FakeGateway
from tests.support.serve_process import free_port


def test_a_name_with_several_addresses_counts_as_several_gateways_in_order():
    resolved = {"gw.example.test": ["10.0.0.1", "10.0.0.2"], "[::1]": []}
    found = candidates(
        ["gw.example.test:8443", "10.0.0.9:9443", "[2001:db8::1]:8443", "gone.example.test:1"],
        resolver=lambda host, port: resolved.get(host, []),
    )
    assert [(c.host, c.port) for c in found] == [
        ("10.0.0.1", 8443),
        ("10.0.0.2", 8443),
        ("10.0.0.9", 9443),
        ("2001:db8::1", 8443),
        ("gone.example.test", 1),  # kept, to fail (and be logged) when it is tried
    ]
    assert found[1].label == "gw.example.test:8443 (10.0.0.2)"
    assert found[2].label == "10.0.0.9:9443"
    # Having lost the second, the agent starts with the third and comes round to the first last.
    assert rotated(found, found[1])[:2] == [found[2], found[3]] and rotated(found, found[1])[-1] == found[1]
    assert rotated(found, None) == found
    assert needs_resolving(["10.0.0.9:9443", "gw.example.test:8443"])
    assert not needs_resolving(["10.0.0.9:9443", "[2001:db8::1]:8443"])
    assert rotated(found, Candidate("other:1", "other", 1)) == found


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not reached in time"
        await asyncio.sleep(0.02)


def _twin(first: FakeGateway, second: FakeGateway) -> None:
    """The second stands for another serve process of the same control plane: same certificate (one
    data directory), same signing key, same workloads."""
    second.signing_key, second.signing_public_key = first.signing_key, first.signing_public_key
    second.workloads, second.serials, second.tokens = first.workloads, first.serials, first.tokens


def test_the_agent_enrols_through_the_first_gateway_that_answers_and_fails_over_to_the_next(tmp_path):
    async def main() -> None:
        first = await FakeGateway(tmp_path / "gateway").start()
        second = await FakeGateway(tmp_path / "gateway").start()
        _twin(first, second)
        dead = f"127.0.0.1:{free_port()}"  # nothing listens: refused at once
        gateways = [dead, first.address, second.address]
        from agent.bundle import bundle_encode

        bundle = bundle_encode(gateways=gateways, fingerprint=first.fingerprint, token=first.add_token())
        assert bundle.startswith("palisade-enrol-v2:")
        state_dir = tmp_path / "state"
        loop = asyncio.get_running_loop()
        identity = await loop.run_in_executor(
            None, lambda: enrol(bundle, str(state_dir), hostname="web-1", addresses=["10.0.0.5"])
        )
        assert identity.gateway == first.address  # the one that answered
        kept = json.loads((state_dir / "gateways.json").read_text())
        assert kept["gateways"] == gateways
        logs = io.StringIO()
        agent = Agent(
            StateDir(state_dir), DataplaneWorker.inline(RecordingDataplane()), log=EventLog(stream=logs)
        )
        task = asyncio.ensure_future(agent.run())
        try:
            auth = await first.wait_for(lambda e: e["kind"] == "auth")
            assert auth["data"]["gateway"] == first.address
            await _until(lambda: agent.connected_gateway == first.address)
            doc = collect(StateDir(state_dir))
            assert doc["stream"]["state"] == "connected" and doc["stream"]["gateway"] == first.address
            assert f"stream:       connected to {first.address}" in render(doc)
            assert f"gateways:     {', '.join(gateways)}" in render(doc)

            # The gateway's process goes: the stream moves to the next gateway, well within 10 s.
            lost_at = time.monotonic()
            await first.close()
            auth = await second.wait_for(lambda e: e["kind"] == "auth", timeout=10)
            assert auth["data"]["gateway"] == second.address
            await _until(lambda: agent.connected_gateway == second.address)
            assert time.monotonic() - lost_at < 10

            # A new list over the stream: kept for the next connection, no re-enrolment.
            workload = identity.workload_id
            changed = [second.address, "gw-c.example.test:8443"]
            await second.streams[workload].send(p.Gateways(addresses=changed).encode())
            await _until(lambda: agent.gateways == changed)
            assert json.loads((state_dir / "gateways.json").read_text())["gateways"] == changed
            assert json.loads((state_dir / "identity.json").read_text())["workload_id"] == workload
            assert "gateways changed gateways=" in logs.getvalue()

            # A list that is no list is malformed: the stream closes, the kept list stays.
            mark = len(second.events)
            await second.streams[workload].send(p.Gateways(addresses=[]).encode())
            closed = await second.wait_for(lambda e: e["kind"] == "closed", start=mark)
            assert closed.get("code") == p.CLOSE_MALFORMED, closed
            assert json.loads((state_dir / "gateways.json").read_text())["gateways"] == changed
        finally:
            agent.stop("test")
            await asyncio.wait_for(task, 15)
            await second.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_an_enrolment_made_before_there_were_several_gateways_uses_its_one(tmp_path):
    async def main() -> None:
        gateway = await FakeGateway(tmp_path / "gateway").start()
        state_dir = tmp_path / "state"
        bundle = gateway.bundle(gateway.add_token())
        assert bundle.startswith("palisade-enrol-v1:")
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: enrol(bundle, str(state_dir), hostname="web-1", addresses=["10.0.0.5"])
        )
        (state_dir / "gateways.json").unlink()  # as an agent of the previous version left it
        state = StateDir(state_dir)
        assert state.load_gateways(state.load_identity()) == [gateway.address]
        await gateway.close()

    asyncio.run(main())

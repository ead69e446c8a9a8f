"""The daemon's conversation, driven by the stand-in gateway, with the in-memory dataplane: fault
injection a correct server never produces, and exact message sequences. What the real serve does is
checked against it in test_daemon_on_serve.py.

Each test runs one asyncio scenario: a FakeGateway and one real `Agent` on the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

from agent import protocol as p
from agent.credential import credential_parse
from agent.daemon import Agent, CredentialBeyondGrace, CredentialRevoked
from agent.enrol import enrol
from agent.eventlog import EventLog
from agent.simulated import RecordingDataplane
from agent.state import StateDir
from agent.tablediff import ADDED
from agent.tablewatch import Transaction
from agent.worker import DataplaneWorker
from tests.support.agent_helpers import as_sent, document
from tests.support.fake_gateway import FakeGateway


@dataclass
class World:
    gateway: FakeGateway
    agent: Agent
    dataplane: RecordingDataplane
    workload: str
    logs: io.StringIO
    task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.agent.run())

    async def stop(self) -> None:
        self.agent.stop("test")
        await asyncio.wait_for(self.task, 15)

    def mark(self) -> int:
        return len(self.gateway.events)

    async def message(self, kind: str, start: int = 0, timeout: float = 15) -> dict:
        event = await self.gateway.wait_for(
            lambda e: e["kind"] == "message" and e["type"] == kind and e["workload"] == self.workload,
            timeout,
            start,
        )
        return event["data"]

    async def event(self, kind: str, start: int = 0, timeout: float = 15, **match) -> dict:
        return await self.gateway.wait_for(
            lambda e: e["kind"] == kind and all(e.get(k) == v for k, v in match.items()), timeout, start
        )

    def log_lines(self) -> list[str]:
        return [line.split(" ", 1)[1] for line in self.logs.getvalue().splitlines()]

    def types_between(self, start: int, end: int | None = None) -> list[str]:
        return [e["type"] for e in self.gateway.events[start:end] if e["kind"] == "message"]


def scenario(
    tmp_path, body: Callable[[World], Awaitable[None]], *, heartbeat: float = 30.0, prepare=None
) -> None:
    async def main() -> None:
        gateway = await FakeGateway(tmp_path / "gateway").start()
        bundle = gateway.bundle(gateway.add_token())
        state_dir = str(tmp_path / "state")
        loop = asyncio.get_running_loop()
        identity = await loop.run_in_executor(
            None, lambda: enrol(bundle, state_dir, hostname="web-1", addresses=["10.0.0.5"])
        )
        dataplane = RecordingDataplane()
        logs = io.StringIO()
        agent = Agent(
            StateDir(state_dir),
            DataplaneWorker.inline(dataplane),
            heartbeat_seconds=heartbeat,
            log=EventLog(stream=logs),
        )
        world = World(gateway, agent, dataplane, identity.workload_id, logs)
        if prepare is not None:
            await prepare(world)
        try:
            await body(world)
        finally:
            if world.task is not None and not world.task.done():
                await world.stop()
            await gateway.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_snapshot_is_applied_and_acknowledged(tmp_path):
    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"), mode="simulation")
        w.start()
        assert await w.message("applied") == {"v": 1, "type": "applied", "version": "v1"}
        assert as_sent(w.dataplane.current) == document("v1")
        auth = (await w.event("auth"))["data"]
        # No table yet is not one removed: nothing applied by this process, so `unknown`.
        assert auth["owned_table"] == "unknown" and auth["agent_version"] == "0.1.0"
        assert await w.message("table") == {"v": 1, "type": "table", "state": "present"}

        mark = w.mark()
        await w.gateway.push_snapshot(w.workload, "v2", document("v2"))
        assert (await w.message("applied", mark))["version"] == "v2"
        assert as_sent(w.dataplane.current) == document("v2") and w.dataplane.applies == 2

        status = json.loads((w.agent.state.file("status.json")).read_text())
        assert status["stream"]["state"] == "connected"
        assert status["applied"]["version"] == "v2" and status["mode"] == "enforced"
        assert status["owned_table"]["state"] == "present"
        await w.stop()
        lines = w.log_lines()
        assert "applied version=v1 mode=simulation" in lines
        assert "applied version=v2 mode=enforced" in lines
        assert any(line.startswith("stream connected workload=") for line in lines)
        assert json.loads(w.agent.state.file("status.json").read_text())["stream"]["state"] == "disconnected"

    scenario(tmp_path, body)


def test_failed_apply_reports_the_error_and_keeps_the_table(tmp_path):
    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"))
        w.start()
        await w.message("applied")
        mark = w.mark()
        w.dataplane.fail_with = "document:3:5-9: Error: syntax error, unexpected junk"
        await w.gateway.push_snapshot(w.workload, "v2", document("v2"))
        failed = await w.message("failed", mark)
        assert failed["version"] == "v2" and "syntax error" in failed["error"]
        assert as_sent(w.dataplane.current) == document("v1")

        mark = w.mark()
        w.dataplane.fail_with = None
        await w.gateway.push_snapshot(w.workload, "v3", "table ip other { }")
        failed = await w.message("failed", mark)
        assert "must be exactly one 'table inet palisade" in failed["error"]
        assert any(line.startswith("apply failed version=v2 error=") for line in w.log_lines())
        status = json.loads(w.agent.state.file("status.json").read_text())
        assert status["applied"]["version"] == "v1" and "v3" in status["last_error"]["message"]

    scenario(tmp_path, body)


def test_same_version_after_a_plain_reconnect_is_acknowledged_without_reapplying(tmp_path):
    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"))
        w.start()
        await w.message("applied")
        mark = w.mark()
        await w.gateway.close_stream(w.workload, 4503, "shutting down")
        assert (await w.message("applied", mark))["version"] == "v1"
        assert w.dataplane.applies == 1
        lines = w.log_lines()
        assert 'stream closed code=4503 reason="shutting down"' in lines
        assert any(line.startswith("backoff seconds=") for line in lines)
        assert "already applied version=v1" in lines

    scenario(tmp_path, body)


def test_outside_delete_is_reported_and_only_a_snapshot_restores(tmp_path):
    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"))
        w.start()
        await w.message("applied")
        await w.message("table")
        mark = w.mark()
        w.dataplane.remove()  # someone pulled the kill switch
        w.agent.table_event("absent")  # what the netlink watcher reports
        assert (await w.message("table", mark))["state"] == "absent"
        await asyncio.sleep(0.3)
        assert w.dataplane.current is None, "the agent must not restore its table by itself"

        mark = w.mark()
        await w.gateway.resend(w.workload)
        await w.event("closed", mark, code=4100)
        assert (await w.message("applied", mark))["version"] == "v1"
        assert (await w.message("table", mark))["state"] == "present"
        assert as_sent(w.dataplane.current) == document("v1") and w.dataplane.applies == 2
        assert (
            "table absent" in w.log_lines() and "reconnect requested reason=resend-snapshot" in w.log_lines()
        )

    scenario(tmp_path, body)


def _edit(kind: str, name: str, verb: str, member: str = "") -> Transaction:
    edit = Transaction()
    edit.changes.add(kind, name, verb, member)
    return edit


def test_a_hand_edit_is_put_right_in_one_replace_and_reported(tmp_path):
    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"))
        w.start()
        await w.message("applied")
        mark = w.mark()
        w.dataplane.current = document("v1").replace("accept", "accept\n    tcp dport 9090 accept", 1)
        w.agent.table_transaction(_edit("chain", "input", ADDED, "rule"))  # what the watcher reads
        w.agent.table_transaction(_edit("set", "allow_v4_3", ADDED, "element"))  # the same moment
        edit = await w.message("table_modified", mark)
        assert edit["description"] == "chain input: 1 rule added; set allow_v4_3: 1 element added"
        assert edit["modified_at"] <= edit["restored_at"]
        assert (
            as_sent(w.dataplane.current) == document("v1") and w.dataplane.applies == 2
        )  # both put right at once
        assert w.agent.table_modifications == 1 and w.agent.owned_table == "present"
        assert w.agent.status.data["table_modified"]["description"] == edit["description"]

        # Our own replace (the table deleted and made again while we apply) is no edit; another
        # process's replace of the whole table is one.
        mark = w.mark()
        await w.gateway.push_snapshot(w.workload, "v2", document("v2"))
        await w.message("applied", mark)
        w.agent._applying = True
        w.agent.table_transaction(Transaction(state="present", deleted=True))
        w.agent._applying = False
        await asyncio.sleep(0.2)
        assert w.agent.table_modifications == 1 and "table_modified" not in w.types_between(mark)
        w.agent.table_transaction(Transaction(state="present", deleted=True))
        assert (await w.message("table_modified", mark))["description"] == "table replaced"
        assert as_sent(w.dataplane.current) == document("v2")

    scenario(tmp_path, body)


def test_after_the_kill_switch_an_edit_is_not_put_right(tmp_path):
    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"))
        w.start()
        await w.message("applied")
        mark = w.mark()
        w.dataplane.remove()
        w.agent.table_event("absent")
        await w.message("table", mark)
        w.dataplane.current = "table inet palisade { }"  # made again by hand
        w.agent.table_transaction(Transaction(state="present"))
        w.agent.table_transaction(_edit("chain", "input", ADDED))
        await asyncio.sleep(0.3)
        assert w.dataplane.current == "table inet palisade { }" and w.dataplane.applies == 1
        assert "table_modified" not in w.types_between(mark)
        assert any('restored="no: the table was deleted (kill switch)"' in line for line in w.log_lines())

    scenario(tmp_path, body)


def test_resend_reapplies_even_when_the_table_is_present(tmp_path):
    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"))
        w.start()
        await w.message("applied")
        mark = w.mark()
        await w.gateway.resend(w.workload)
        await w.message("applied", mark)
        assert w.dataplane.applies == 2  # a resend may be meant to wipe foreign rules: apply again

    scenario(tmp_path, body)


def test_heartbeats_carry_the_table_state_and_catch_a_missed_delete(tmp_path):
    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"))
        w.start()
        auth = (await w.event("auth"))["data"]
        await w.message("applied")
        beat = await w.message("heartbeat", w.mark())
        assert beat["process_start_id"] == auth["process_start_id"]
        assert beat["owned_table"] == "present" and beat["clock"].endswith("Z")
        assert beat["uptime_seconds"] >= auth["uptime_seconds"]

        mark = w.mark()
        w.dataplane.remove()  # no watcher event: the heartbeat's own check must notice
        assert (await w.message("table", mark))["state"] == "absent"
        assert (await w.message("heartbeat", mark))["owned_table"] == "absent"

    scenario(tmp_path, body, heartbeat=0.2)


def test_a_table_never_written_is_unknown_not_removed_until_the_first_apply(tmp_path):
    """`absent` tells operators (and webhooks) that enforcement was removed: a fresh agent whose first
    document is refused has no table yet, and says `unknown` until an apply writes one."""

    async def body(w: World) -> None:
        w.dataplane.fail_with = "document:1:1-4: Error: syntax error"
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"))
        w.start()
        assert (await w.event("auth"))["data"]["owned_table"] == "unknown"
        await w.message("failed")
        mark = w.mark()
        assert (await w.message("heartbeat", mark))["owned_table"] == "unknown"
        assert w.agent.owned_table == "absent"  # the agent's own status and metrics say what it saw

        w.dataplane.fail_with = None
        await w.gateway.push_snapshot(w.workload, "v2", document("v2"))
        await w.message("applied", mark)
        assert "table" not in w.types_between(0, mark)
        assert (await w.message("table", mark))["state"] == "present"
        removed = w.mark()
        w.dataplane.remove()
        assert (await w.message("table", removed))["state"] == "absent"  # written once: now removed

    scenario(tmp_path, body, heartbeat=0.2)


def test_a_table_check_outrun_by_the_watchers_delete_does_not_put_present_back(tmp_path):
    """The heartbeat's check lists the tables just before a delete and answers after the watcher saw it:
    that answer is stale, and would report `present` (to the API, for a heartbeat) after `absent`."""

    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"))
        w.start()
        await w.message("applied")
        await w.message("table")
        asked, answer = asyncio.Event(), asyncio.Event()

        async def listed_before_the_delete() -> bool:
            asked.set()
            await answer.wait()
            return True

        w.agent.dataplane.table_present = listed_before_the_delete
        await asyncio.wait_for(asked.wait(), 5)  # the next heartbeat is asking the kernel now
        mark = w.mark()
        w.dataplane.remove()
        w.agent.table_event("absent")  # the watcher's verdict, while the check waits
        answer.set()
        assert (await w.message("table", mark))["state"] == "absent"
        assert (await w.message("heartbeat", mark))["owned_table"] == "absent"
        assert [m for m in w.types_between(mark) if m == "table"] == ["table"]
        assert w.agent.owned_table == "absent"

    scenario(tmp_path, body, heartbeat=0.2)


def test_renewal_when_due(tmp_path):
    async def prepare(w: World) -> None:
        w.gateway.welcome_renewal_due_seconds = -1  # due already

    async def body(w: World) -> None:
        before = credential_parse(w.agent.state.load_credential())
        w.start()
        await w.message("renew")
        await asyncio.sleep(0.2)
        after = credential_parse(w.agent.state.load_credential())
        assert after["serial"] > before["serial"] and after["public_key"] == before["public_key"]
        assert any(line.startswith("credential renewed expires_at=") for line in w.log_lines())
        status = json.loads(w.agent.state.file("status.json").read_text())
        assert status["credential"]["expires_at"] == after["expires_at"]
        assert len(w.gateway.messages("renew")) == 1  # renewed once; the next is due much later

    scenario(tmp_path, body, prepare=prepare)


def test_a_host_clock_days_ahead_renews_by_the_control_planes_clock_not_its_own(tmp_path):
    """Due in an hour by the gateway's clock, two weeks ago by this host's: no renewal, and no loop of
    them (each new credential would be due in the past again by the host's clock)."""
    from datetime import timedelta

    async def prepare(w: World) -> None:
        w.gateway.clock_offset = -timedelta(days=15)
        w.gateway.welcome_renewal_due_seconds = 3600

    async def body(w: World) -> None:
        w.start()
        await w.message("heartbeat")
        await w.message("heartbeat", w.mark())
        assert w.gateway.messages("renew") == []
        offset = w.agent.server_offset + timedelta(days=15)
        assert abs(offset) < timedelta(seconds=5), w.agent.server_offset

    scenario(tmp_path, body, heartbeat=0.2, prepare=prepare)


def test_flow_reports_judge_the_credential_by_the_control_planes_clock(tmp_path):
    """A host clock past the credential's expiry: reports are held back only if the control plane's
    clock agrees (else they go, to a stand-in gateway that has no flow endpoint)."""
    import http.client
    import time

    from agent.flowreporter import FlowReporter, FlowSettings

    ahead = 400 * 86400  # beyond any credential the stand-in gateway issues

    def reporter(w: World, control_plane_clock) -> FlowReporter:
        return FlowReporter(
            w.agent.state,
            settings=FlowSettings(),
            context=lambda: w.agent._context,
            policy_version=lambda: "v1",
            table_absent=lambda: False,
            process_start_id="p1",
            log=w.agent.log,
            sources={},
            accounting=False,
            clock=lambda: time.time() + ahead,
            control_plane_clock=control_plane_clock,
        )

    async def body(w: World) -> None:
        w.start()
        await w.message("heartbeat")  # connected: the control plane's clock is known
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, reporter(w, None).send_pending) is False
        assert "flow report waits for the credential's renewal" in w.logs.getvalue()
        by_server = reporter(w, lambda: w.agent.server_now().timestamp())
        with pytest.raises(http.client.HTTPException):  # it went: the stand-in hangs up on it
            await loop.run_in_executor(None, by_server.send_pending)

    scenario(tmp_path, body, heartbeat=0.2)


def test_a_renewed_credential_that_does_not_verify_is_reported_and_not_stored(tmp_path):
    async def prepare(w: World) -> None:
        w.gateway.welcome_renewal_due_seconds = -1
        w.gateway.forge_renewals = True

    async def body(w: World) -> None:
        before = w.agent.state.load_credential()
        w.start()
        failed = await w.message("renewal_failed")
        assert "signature does not verify" in failed["error"]
        assert w.agent.state.load_credential() == before
        assert any(line.startswith("renewal failed error=") for line in w.log_lines())

    scenario(tmp_path, body, prepare=prepare)


def test_renew_only_sends_renew_and_nothing_else_then_reconnects(tmp_path):
    async def prepare(w: World) -> None:
        w.gateway.renew_only.add(w.workload)

    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"))
        w.start()
        first = await w.event("connected", renew_only=True)
        closed = await w.event("closed", w.gateway.events.index(first))
        assert closed["code"] == 1000
        assert w.types_between(w.gateway.events.index(first), w.gateway.events.index(closed)) == ["renew"]
        await w.message("applied", w.gateway.events.index(closed))  # the next stream is a normal one
        assert any(line.startswith("stream connected") and "renew_only=yes" in line for line in w.log_lines())

    scenario(tmp_path, body, heartbeat=0.1, prepare=prepare)


def test_close_4403_stops_with_a_reenrol_error(tmp_path):
    async def prepare(w: World) -> None:
        w.gateway.refuse[w.workload] = (4403, "credential expired beyond its grace")

    async def body(w: World) -> None:
        with pytest.raises(CredentialBeyondGrace, match="re-enrol"):
            await asyncio.wait_for(w.agent.run(), 15)
        assert len([e for e in w.gateway.events if e["kind"] == "auth"]) == 1  # no retry

    scenario(tmp_path, body, prepare=prepare)


def test_close_4410_stops_saying_the_credential_was_revoked_and_how_to_come_back(tmp_path):
    async def prepare(w: World) -> None:
        w.gateway.refuse[w.workload] = (4410, "the operator revoked the credential")

    async def body(w: World) -> None:
        with pytest.raises(CredentialRevoked, match="revoked the credential") as stopped:
            await asyncio.wait_for(w.agent.run(), 15)
        assert f"--workload-id {w.workload}" in stopped.value.message
        assert stopped.value.exit_code == 3  # systemd need not restart it
        assert len([e for e in w.gateway.events if e["kind"] == "auth"]) == 1  # no retry
        status = json.loads(w.agent.state.file("status.json").read_text())
        assert "revoked" in status["last_error"]["message"]

    scenario(tmp_path, body, prepare=prepare)


def test_close_4500_after_a_failed_renewal_backs_off_and_tries_again(tmp_path):
    """The control plane failed on its side: the agent keeps running and retries, it does not exit."""

    async def prepare(w: World) -> None:
        w.gateway.refuse[w.workload] = (4500, "renewal failed: try again later")

    async def body(w: World) -> None:
        w.start()
        first = await w.event("auth")
        await w.event("auth", w.gateway.events.index(first) + 1, timeout=20)
        lines = w.log_lines()
        assert 'stream closed code=4500 reason="renewal failed: try again later"' in lines
        assert any(line.startswith("backoff ") for line in lines)
        status = json.loads(w.agent.state.file("status.json").read_text())
        assert status["last_error"]["message"].endswith("; retrying")

    scenario(tmp_path, body, prepare=prepare)


def test_close_4503_without_the_database_waits_as_long_as_its_reason_says(tmp_path):
    async def prepare(w: World) -> None:
        w.gateway.refuse[w.workload] = (4503, "database unavailable: retry after 1 s")

    async def body(w: World) -> None:
        w.start()
        first = await w.event("auth")
        await w.event("auth", w.gateway.events.index(first) + 1, timeout=20)
        lines = w.log_lines()
        assert 'stream closed code=4503 reason="database unavailable: retry after 1 s"' in lines
        assert "backoff seconds=1.00 attempt=1" in lines

    scenario(tmp_path, body, prepare=prepare)


def test_close_4401_backs_off_and_tries_again(tmp_path):
    async def prepare(w: World) -> None:
        w.gateway.refuse[w.workload] = (4401, "bad proof")

    async def body(w: World) -> None:
        w.start()
        first = await w.event("auth")
        await w.event("auth", w.gateway.events.index(first) + 1, timeout=20)
        lines = w.log_lines()
        assert 'stream closed code=4401 reason="bad proof"' in lines
        assert any(line.startswith("backoff ") for line in lines)

    scenario(tmp_path, body, prepare=prepare)


def test_unreachable_gateway_backs_off_and_keeps_the_table(tmp_path):
    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"))
        w.start()
        await w.message("applied")
        await w.gateway.close()  # the control plane goes away
        for stream in list(w.gateway.streams.values()):
            await stream.close(1001, "going away")
        await _until(lambda: sum(line.startswith("stream error") for line in w.log_lines()) >= 2, pause=0.1)
        assert sum(line.startswith("stream error") for line in w.log_lines()) >= 2
        assert as_sent(w.dataplane.current) == document("v1")  # fail static
        status = json.loads(w.agent.state.file("status.json").read_text())
        assert status["stream"]["state"] in ("connecting", "disconnected") and status["last_error"]

    scenario(tmp_path, body)


def test_stop_closes_the_stream_with_1000_and_leaves_the_table(tmp_path):
    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"))
        w.start()
        await w.message("applied")
        mark = w.mark()
        await w.stop()
        closed = await w.event("closed", mark)
        assert closed["code"] == 1000
        assert as_sent(w.dataplane.current) == document("v1")
        assert w.log_lines()[-2:] == ["stopping reason=test", "stopped"]

    scenario(tmp_path, body)


def test_a_malformed_frame_closes_with_4000(tmp_path):
    async def body(w: World) -> None:
        w.start()
        connected = await w.event("connected")
        await w.gateway.streams[w.workload].send('{"v": 1, "type": "snapshot", "version": 7}')
        closed = await w.event("closed", w.gateway.events.index(connected))
        assert closed["code"] == 4000
        await w.event("connected", w.gateway.events.index(closed))  # and it comes back

    scenario(tmp_path, body)


def test_an_outbound_table_gets_every_listed_gateway_in_its_gateway_sets(tmp_path):
    """The gateway sets are filled with every gateway the agent lists (StateDir.load_gateways: any of
    them may be the next it connects to, under an enforced output chain), not only the one it uses."""
    with_sets = document("v1").replace(
        "table inet palisade {\n",
        "table inet palisade {\n"
        "\tset agent_gateways_v4 {\n\t\ttype ipv4_addr . inet_service\n\t}\n"
        "\tset agent_gateways_v6 {\n\t\ttype ipv6_addr . inet_service\n\t}\n",
    )

    async def prepare(w: World) -> None:
        listed = [*w.agent.gateways, "192.0.2.10:8443", "[2001:db8::10]:9443"]
        w.agent.state.write_gateways(listed, updated_at="2026-11-28T00:00:00Z")
        w.agent.gateways = w.agent.state.load_gateways(w.agent.identity)
        assert w.agent.gateways == listed

    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", with_sets, mode="enforced")
        w.start()
        await w.message("applied")
        applied = w.dataplane.current
        assert "192.0.2.10 . 8443" in applied and "2001:db8::10 . 9443" in applied
        assert "127.0.0.1 . " in applied  # the gateway it is connected to

    scenario(tmp_path, body, prepare=prepare)


def test_a_document_without_an_output_chain_gets_the_observe_only_one_and_the_gateway_sets(tmp_path):
    """Outbound visibility: the rendered document has no output chain; the agent adds one that marks new
    outgoing connections observed (outbound) and judges nothing (agent/outbound_observe.py), its gateway
    sets filled, so that its own connections to the control plane are not evidence."""

    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"), mode="visibility")
        w.start()
        await w.message("applied")
        applied = w.dataplane.current
        assert as_sent(applied) == document("v1")
        chain = applied[applied.index("\tchain output {") :]
        assert "ct state new ct mark set 0x81000000 accept" in chain
        assert " drop" not in chain and "reject" not in chain and "log " not in chain
        assert "elements = { 127.0.0.1 . " in applied  # the gateway it is connected to
        # A document with an output chain of its own (an outbound mode other than visibility) gets none.
        mark = w.mark()
        own = document("v2").replace(
            "}\n}\n", "}\n\tchain output {\n\t\ttype filter hook output priority 0;\n\t}\n}\n"
        )
        await w.gateway.push_snapshot(w.workload, "v2", own, mode="visibility")
        await w.message("applied", mark)
        assert w.dataplane.current == own and "0x81000000" not in w.dataplane.current

    scenario(tmp_path, body)


def test_a_pushed_list_of_gateways_is_in_the_table_at_once_without_a_new_version(tmp_path):
    """Issue 36 item 1 with issue 34 item 4: a changed list over the stream refills the gateway sets of
    the table in place (one replace of the last applied table), not only at the next policy version."""

    async def body(w: World) -> None:
        await w.gateway.push_snapshot(w.workload, "v1", document("v1"), mode="enforced")
        w.start()
        await w.message("applied")
        assert "192.0.2.10" not in w.dataplane.current and w.dataplane.applies == 1
        mark = w.mark()
        changed = [*w.agent.gateways, "192.0.2.10:8443", "[2001:db8::10]:9443"]
        await w.gateway.streams[w.workload].send(p.Gateways(addresses=changed).encode())
        deadline = time.monotonic() + 10
        while w.dataplane.applies < 2:
            assert time.monotonic() < deadline, "the gateway sets were not refilled"
            await asyncio.sleep(0.02)
        applied = w.dataplane.current
        assert "192.0.2.10 . 8443" in applied and "2001:db8::10 . 9443" in applied
        assert "127.0.0.1 . " in applied and as_sent(applied) == document("v1")
        assert w.agent.applied_document == applied  # what a hand edit is undone with
        assert "applied" not in w.types_between(mark) and w.agent.applied_version == "v1"
        assert "gateway sets applied version=v1" in w.log_lines()
        # The same list again changes nothing; after the kill switch nothing is put back.
        await w.gateway.streams[w.workload].send(p.Gateways(addresses=changed).encode())
        w.dataplane.remove()
        w.agent.table_event("absent")
        await w.message("table", mark)
        await w.gateway.streams[w.workload].send(p.Gateways(addresses=changed[:1]).encode())
        await asyncio.sleep(0.3)
        assert w.dataplane.current is None and w.dataplane.applies == 2

    scenario(tmp_path, body)


def test_a_handshake_cut_short_leaves_its_socket_to_the_transport_and_the_next_connection_works(tmp_path):
    """The handshake cut short (its time out, the agent stopping) while the TLS transport owns the
    socket: the transport closes it itself. Closing the socket under it as well freed its descriptor
    while the transport still held it; the next connection, given that number at once, failed with
    "File descriptor N is used by transport" instead of trying (3,761 of 10,000 simulated agents stuck
    so). Cut at every step of the event loop from the connect to the upgrade, each next attempt must
    get as far as its own cut, and a last one time out."""
    from agent.gateways import Candidate

    async def body(w: World) -> None:
        async def silent(reader, writer):  # the upgrade request is read and never answered
            await reader.read(65536)

        server = await asyncio.start_server(silent, "127.0.0.1", 0, ssl=w.gateway.tls)
        port = server.sockets[0].getsockname()[1]
        candidate = Candidate(address=f"127.0.0.1:{port}", host="127.0.0.1", port=port)
        w.agent._load()
        w.agent.open_seconds = 0.3
        failures: dict[str, int] = {}

        async def attempt(steps: int | None) -> None:
            opening = asyncio.ensure_future(w.agent._open(candidate))
            if steps is not None:
                for _ in range(steps):
                    await asyncio.sleep(0)
                opening.cancel()
            try:
                await opening
            except (asyncio.CancelledError, TimeoutError):
                pass
            except Exception as error:  # noqa: BLE001 - counted by kind below
                what = f"{type(error).__name__}: {error}"
                failures[what] = failures.get(what, 0) + 1

        try:
            for steps in range(60):
                await attempt(steps)
            await attempt(None)
        finally:
            server.close()
        assert failures == {}

    scenario(tmp_path, body)


async def _until(condition, *, tries: int = 100, pause: float = 0.05) -> None:
    """Wait until `condition()` holds, or the tries run out: the assertion after it says what was due."""
    for _ in range(tries):
        if condition():
            return
        await asyncio.sleep(pause)


def _backoff_caps_recorded(monkeypatch) -> list[float]:
    """The cap of every backoff the agent draws (busy or not), each wait cut to 10 ms."""
    from agent import daemon
    from agent.backoff import BACKOFF_CAP

    caps: list[float] = []

    def recorded(attempt, retry_after, *, spread=True, rng=None, cap=BACKOFF_CAP):
        caps.append(cap)
        return 0.01

    monkeypatch.setattr(daemon, "retry_delay", recorded)
    return caps


def test_a_gateway_resetting_at_accept_is_busy_and_the_backoff_stays_short(tmp_path, monkeypatch):
    """A gateway at its bound on unfinished handshakes closes a new connection as it accepts it (before
    TLS): the agent tries its next gateway, then backs off with full jitter doubling to 15 s, not 60 s,
    since that gateway is up and has room again once its admitted handshakes finish. A gateway that is
    gone keeps the usual backoff."""
    from agent.backoff import BACKOFF_CAP, BUSY_CAP

    caps = _backoff_caps_recorded(monkeypatch)

    async def body(w: World) -> None:
        async def reset_at_accept(reader, writer):
            writer.transport.abort()

        busy = await asyncio.start_server(reset_at_accept, "127.0.0.1", 0)
        busy_port = busy.sockets[0].getsockname()[1]
        gone = await asyncio.start_server(reset_at_accept, "127.0.0.1", 0)
        gone_port = gone.sockets[0].getsockname()[1]
        gone.close()
        await gone.wait_closed()
        try:
            w.agent.gateways = [f"127.0.0.1:{busy_port}", f"127.0.0.1:{gone_port}"]
            w.start()
            await _until(lambda: len(caps) >= 4)
            assert caps[:4] == [BUSY_CAP] * 4
            assert any("connection reset before the stream (busy)" in line for line in w.log_lines())
            busy.close()
            await busy.wait_closed()
            seen = len(caps)
            await _until(lambda: len(caps) >= seen + 3)
            assert caps[-1] == BACKOFF_CAP  # both gone now
        finally:
            busy.close()

    scenario(tmp_path, body)


@contextlib.contextmanager
def _listen_queue_full():
    """HOST:PORT of a listener that accepts nothing and whose kernel queue is full: a new connection's
    SYN is dropped and its connect times out, as at a failover's survivor that stopped accepting."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # one connection fills its queue
    fillers = []
    try:
        for _ in range(2):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(listener.getsockname())
            fillers.append(filler)
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def test_a_gateway_whose_listen_queue_is_full_is_busy_not_gone(tmp_path, monkeypatch):
    """A listener that stops accepting fills its kernel queue, and the SYNs after that are dropped:
    the agent's TCP connection times out. That is a failover's survivor at its bound as much as a
    host that is gone, so the busy backoff (to 15 s) applies and the error says both."""
    from agent import daemon
    from agent.backoff import BUSY_CAP

    caps = _backoff_caps_recorded(monkeypatch)
    monkeypatch.setattr(daemon, "CONNECT_SECONDS", 0.2)

    async def body(w: World) -> None:
        with _listen_queue_full() as full:
            w.agent.gateways = [full]
            w.start()
            await _until(lambda: len(caps) >= 2)
            assert caps[:2] == [BUSY_CAP] * 2
            assert any(
                "TCP connection timed out (busy, or its host is gone)" in line for line in w.log_lines()
            )

    scenario(tmp_path, body)


def test_the_lost_gateway_stays_last_in_every_try_until_a_stream_opens(tmp_path, monkeypatch):
    """Its stream lost, the agent tries the next gateway first; when that one is busy too, each
    following round of tries still leaves the lost one for last (before, the second round started with
    it again, paying a gone host's connect timeout before every try of the others)."""
    from agent import daemon

    _backoff_caps_recorded(monkeypatch)
    monkeypatch.setattr(daemon, "CONNECT_SECONDS", 0.2)

    async def body(w: World) -> None:
        with _listen_queue_full() as busy:
            lost = w.agent.gateways[0]
            w.agent.gateways = [lost, busy]
            w.start()
            await w.event("connected")
            await w.gateway.close()  # the first gateway goes away
            for stream in list(w.gateway.streams.values()):
                await stream.close(1001, "going away")

            def tried() -> list[str]:
                lines = w.log_lines()
                since = max(i for i, line in enumerate(lines) if line.startswith("stream connected"))
                return [
                    line.split("url=wss://", 1)[1].split("/", 1)[0]
                    for line in lines[since:]
                    if line.startswith("stream connecting")
                ]

            await _until(lambda: len(tried()) >= 6)
            assert tried()[:6] == [busy, lost] * 3

    scenario(tmp_path, body)


def test_a_gateway_that_takes_the_connection_but_not_the_handshake_in_time_is_busy(tmp_path, monkeypatch):
    """A survivor of a failover at its bound on unfinished handshakes stops accepting: the connections
    wait in its listen queue, and one that waits past the agent's open timeout was never refused, only
    not answered. The host is up, so the busy backoff (to 15 s) applies, not a lost host's (60 s)."""
    from agent.backoff import BUSY_CAP

    caps = _backoff_caps_recorded(monkeypatch)

    async def body(w: World) -> None:
        held: list[asyncio.StreamWriter] = []

        async def silent(reader, writer):
            held.append(writer)  # reads nothing, answers nothing, until the agent gives up

        queued = await asyncio.start_server(silent, "127.0.0.1", 0)
        try:
            w.agent.open_seconds = 0.2
            w.agent.gateways = [f"127.0.0.1:{queued.sockets[0].getsockname()[1]}"]
            w.start()
            await _until(lambda: len(caps) >= 2)
            assert caps[:2] == [BUSY_CAP] * 2
            assert any("TLS handshake or upgrade timed out (busy)" in line for line in w.log_lines())
        finally:
            queued.close()
            for writer in held:
                writer.transport.abort()

    scenario(tmp_path, body)

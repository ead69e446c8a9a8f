"""Fair shares of the gateway's bodies on the real serve (controlplane/body_gate.py), against enrolled
workloads that hold bodies open: one body in flight per workload, room kept for small reports, a pace
every body keeps, and a revocation that takes effect on the header check of every serve process at once.

The hostile uploads here are the probe's: an enrolled agent opens connections announcing 32 MiB reports
and sends 1.6 KB a second, above serve's general minimum (1 KiB/s) and far below the gateway's pace."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent.enrol import enrol
from agent.flowbuffer import gap_record, window_record
from agent.flowreport import report_body
from agent.flowreporter import FlowReporter, FlowSettings
from agent.flowwindow import FlowKey, Windows
from agent.state import StateDir
from agent.tls import pinned_context as agent_pinned_context
from tests.support.flow_reports import post_flow_report
from tests.support.requirements import require
from tests.support.serve_process import Site, pinned_context
from tests.support.uploads import Trickle, Upload, flow_report_head

pytestmark = pytest.mark.e2e

REDIS_TEST_URL = os.environ.get("REDIS_TEST_URL", "redis://127.0.0.1:6379/0")

MiB = 1024 * 1024
CLAIMED = 32 * MiB  # the largest flow report there is
TRICKLE = 1600.0  # bytes a second
REPORTERS = 100
HOSTILE = 5
PACE_GRACE = 10.0  # serve's grace before a body must keep the pace (connection_limits.BODY_GRACE_SECONDS)


def _enrolled(bundle: str, root, n: int):
    enrol(
        bundle, str(root / f"agent-{n}"), hostname=f"agent-{n}", addresses=[f"10.60.{n // 200}.{n % 200 + 1}"]
    )
    return StateDir(root / f"agent-{n}").load_enrolment()


def _enrol_many(serve, root, count: int) -> list:
    operator = serve.client("operator", headers={"Authorization": f"Bearer {serve.mint_operator_token()}"})
    try:
        minted = operator.post("/api/v1/provisioning-tokens", json={"description": "fair", "max_uses": count})
        assert minted.status_code == 201, minted.text
    finally:
        operator.close()
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda n: _enrolled(minted.json()["bundle"], root, n), range(count)))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("fair")
    with Site.fresh(root / "data", migrated=True) as site:
        serve = site.serve()
        serve.gateway_context = pinned_context(serve.served_certificate("gateway"))
        agents = _enrol_many(serve, root, HOSTILE + REPORTERS)
        yield serve, agents, root
        assert serve.stop() == 0
        assert "Traceback" not in serve.stderr_text()


def _report(now: float) -> bytes:
    """A minute's report of a few connections, as an agent sends every minute."""
    windows = Windows(length=60, max_keys=100, accounting=False)
    for port in (22, 443, 5432):
        windows.connection_opened(FlowKey("10.60.9.9", "tcp", port, "observed", None), now - 120)
    closed, gaps = windows.close_due(now, "v1")
    return report_body(
        [window_record(w) for w in closed],
        [gap_record(g) for g in gaps],
        now=now,
        process_start_id="p1",
        uptime_seconds=300.0,
        window_seconds=60,
    )


def _hold(
    serve, agent, *, connections: int = 2, length: int | None = CLAIMED, rate: float = TRICKLE
) -> tuple[list[int], list[Trickle]]:
    """The probe: `connections` uploads of the agent's workload, each announcing `length` bytes (chunked
    when None); those serve admits (100 Continue) go on at `rate` bytes a second. Returns every upload's
    first answer, and the uploads going on."""
    statuses, trickles = [], []
    for _ in range(connections):
        upload = Upload(
            serve,
            flow_report_head(agent.identity.workload_id, agent.credential, length=length, expect=True),
        )
        status = upload.answer()[0]
        statuses.append(status)
        if status == 100:
            trickle = Trickle(upload, rate=rate, chunked=length is None)
            trickle.start()
            trickles.append(trickle)
        else:
            upload.close()
    return statuses, trickles


def _reports_of(serve, agents) -> tuple[list, float]:
    """Each agent's report at once, each over its own connection as the agent sends it; the answers and
    how long they all took."""
    now = time.time()
    started = time.monotonic()
    with ThreadPoolExecutor(len(agents)) as pool:
        answers = list(pool.map(lambda agent: post_flow_report(serve, agent, _report(now)), agents))
    return answers, time.monotonic() - started


@pytest.mark.parametrize("hostile", [1, HOSTILE], ids=["one workload", "five workloads"])
def test_workloads_trickling_32_mib_bodies_keep_no_report_of_100_other_agents_out(fleet, hostile):
    serve, agents, _ = fleet
    holding = []
    try:
        for agent in agents[:hostile]:
            holding += _hold(serve, agent)[1]
        assert holding and all(t.ended is None for t in holding)  # serve is receiving their bodies
        answers, took = _reports_of(serve, agents[HOSTILE : HOSTILE + REPORTERS])
        print(f"{REPORTERS} reports answered in {took:.2f} s beside {len(holding)} trickling bodies")
        statuses = [answer.status_code for answer in answers]
        assert statuses == [200] * REPORTERS, sorted(set(statuses))
        results = [item["result"] for answer in answers for item in answer.json()["windows"]]
        assert results == ["accepted"] * REPORTERS
    finally:
        for trickle in holding:
            trickle.stop()


def test_a_workload_has_one_body_in_flight_and_its_agent_waits_for_it(fleet):
    serve, agents, root = fleet
    agent = agents[0]
    statuses, holding = _hold(serve, agent, connections=1)
    try:
        assert statuses == [100]
        # Another connection of the same workload, also under another spelling of its id.
        for workload in (agent.identity.workload_id, agent.identity.workload_id.upper()):
            second = Upload(serve, flow_report_head(workload, agent.credential, length=CLAIMED))
            try:
                status, headers, body = second.answer()
            finally:
                second.close()
            assert (status, headers["retry-after"], headers["connection"]) == (429, "1", "close")
            problem = json.loads(body)
            assert problem["type"] == "urn:service:problem:rate-limited" and problem["retry_after"] == 1
            assert agent.identity.workload_id in problem["detail"]

        # The agent itself meanwhile: it keeps its windows and waits as long as the 429 asks.
        reporter = FlowReporter(
            StateDir(root / "agent-0"),
            settings=FlowSettings(),
            context=lambda: agent_pinned_context(agent.identity.certificate_pem),
            policy_version=lambda: "v1",
            table_absent=lambda: False,
            process_start_id="p2",
            log=lambda *args, **fields: None,
            sources={},
            accounting=False,
        )
        windows = Windows(length=60, max_keys=10, accounting=False)
        windows.connection_opened(FlowKey("10.60.9.9", "tcp", 443, "observed", None), time.time() - 120)
        reporter.buffer.add(*windows.close_due(time.time(), "v1"))
        waiting = reporter.buffer.pending()
        assert reporter.send_pending() is False and reporter.retry_after == 1
        assert reporter.buffer.pending() == waiting and len(waiting[0]) == 1
    finally:
        for trickle in holding:
            trickle.stop()
    # Its connection gone, the workload's next report is received.
    deadline = time.monotonic() + 10
    while (answer := post_flow_report(serve, agent, _report(time.time()))).status_code == 429:
        assert time.monotonic() < deadline, "the workload's body in flight was never given back"
        time.sleep(0.05)
    assert answer.status_code == 200, answer.text


def test_large_bodies_leave_room_for_small_reports(fleet):
    """Bodies over 1 MiB take at most three quarters of the 64 MiB budget; the rest is kept for reports
    of 1 MiB or less (all of it was theirs: 24 + 24 + 16 MiB left no room for a small report)."""
    serve, agents, _ = fleet
    holding = []
    try:
        statuses = []
        for agent, length in zip(agents[:3], (24 * MiB, 24 * MiB, 16 * MiB), strict=True):
            answered, trickles = _hold(serve, agent, connections=1, length=length)
            statuses += answered
            holding += trickles
        assert statuses == [100, 100, 503]
        small = agents[3]
        upload = Upload(
            serve, flow_report_head(small.identity.workload_id, small.credential, length=MiB, expect=True)
        )
        try:
            assert upload.answer()[0] == 100
        finally:
            upload.close()
    finally:
        for trickle in holding:
            trickle.stop()


def test_bodies_slower_than_the_gateways_pace_are_closed(fleet):
    """A 32 MiB body at 1.6 KB/s, a chunked one at that rate, and a small one that stalls: each is
    closed once it falls behind 16 KiB/s after its grace (serve's general minimum, 1 KiB/s, kept the
    first two for hours)."""
    serve, agents, _ = fleet
    holding = []
    try:
        # (the last declares 1,000 bytes and sends none)
        for agent, length, rate in zip(agents[:3], (CLAIMED, None, 1000), (TRICKLE, TRICKLE, 0), strict=True):
            statuses, trickles = _hold(serve, agent, connections=1, length=length, rate=rate)
            assert statuses == [100]
            holding += trickles
        deadline = time.monotonic() + PACE_GRACE + 20
        while any(trickle.ended is None for trickle in holding):
            assert time.monotonic() < deadline, [(t.ended, t.sent) for t in holding]
            time.sleep(0.2)
        assert [trickle.ended for trickle in holding] == ["closed"] * 3
    finally:
        for trickle in holding:
            trickle.stop()
    serve.wait_for_stderr(r"a request body slower than 16384 bytes/s", timeout=15)


# --- revocation in every serve process ------------------------------------------------------------------


def redis_reachable() -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(REDIS_TEST_URL, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(params=["without Redis", "with Redis"])
def two_processes(tmp_path, request):
    """Two serve processes on one database (and data directory), with or without Redis between them (the
    header check does not depend on it), and three workloads enrolled."""
    env = {"REDIS_URL": ""}
    if request.param == "with Redis":
        require(redis_reachable(), f"needs Redis at {REDIS_TEST_URL} (set REDIS_TEST_URL)")
        env = {"REDIS_URL": REDIS_TEST_URL}
    with Site.fresh(tmp_path / "data", migrated=True) as site:
        first, second = site.serve_together(2, env=env)
        for serve in (first, second):
            serve.gateway_context = pinned_context(serve.served_certificate("gateway"))
        if site.database_url:
            for serve in (first, second):  # on PostgreSQL, passes are trusted once it listens
                serve.wait_for_stderr("listening for credential changes")
        yield site, first, second, _enrol_many(first, tmp_path, 3)
        for serve in (first, second):  # both told at once: their shutdowns overlap too
            serve.process.send_signal(signal.SIGTERM)
        for serve in (first, second):
            assert serve.wait() == 0
            assert "Traceback" not in serve.stderr_text()


def test_a_revocation_takes_effect_on_the_header_check_of_every_serve_process_at_once(two_processes):
    site, first, second, agents = two_processes
    for agent in agents:
        for serve in (first, second):  # their headers passed in both processes
            assert post_flow_report(serve, agent, _report(time.time())).status_code == 200
    operator = first.client("operator", headers={"Authorization": f"Bearer {site.mint_operator_token()}"})
    try:
        revoked = operator.post(
            f"/api/v1/workloads/{agents[0].identity.workload_id}/revoke-credential", json={}
        )
        assert revoked.status_code == 200, revoked.text
    finally:
        operator.close()
    site.manage("workload", "revoke-credential", agents[1].identity.workload_id)

    for agent in agents[:2]:
        for serve in (second, first):
            upload = Upload(
                serve,
                flow_report_head(agent.identity.workload_id, agent.credential, length=CLAIMED, expect=True),
            )
            try:
                status, _, body = upload.answer()
            finally:
                upload.close()
            assert status == 403, f"{status} from {serve.gateway_url} for {agent.identity.workload_id}"
            assert json.loads(body)["type"] == "urn:service:problem:credential-revoked"
    still = Upload(
        second,
        flow_report_head(agents[2].identity.workload_id, agents[2].credential, length=CLAIMED, expect=True),
    )
    try:
        assert still.answer()[0] == 100  # the workload nobody revoked
    finally:
        still.close()

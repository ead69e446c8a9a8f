"""Webhooks end to end: the real serve delivers to a real HTTPS receiver in this process, signed the
Standard Webhooks way; through failures, a receiver that is away, serve killed between the state change
and the delivery, and two serve processes on one PostgreSQL.

The retry schedule is shortened for the tests (PALISADE_WEBHOOK_RETRY_BASE_SECONDS and _CAP_SECONDS)
instead of waited for; every wait polls a condition with a deadline."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections import Counter

import pytest
from standardwebhooks.webhooks import Webhook as Verifier

from agent.enrol import enrol
from agent.flowreport import report_body
from agent.state import StateDir
from tests.support.flow_reports import post_flow_report
from tests.support.requirements import require
from tests.support.serve_process import Site
from tests.support.webhook_receiver import HOLDING, Receiver

FAST = {
    "PALISADE_WEBHOOK_RETRY_BASE_SECONDS": "0.2",
    "PALISADE_WEBHOOK_RETRY_CAP_SECONDS": "1",
    "PALISADE_WEBHOOK_SEND_EVERY_SECONDS": "0.2",
}


def env_for(*receivers: Receiver, **extra) -> dict:
    """Receivers share one certificate (one directory); their loopback ports are listed as admitted."""
    return {
        **FAST,
        "PALISADE_WEBHOOK_CA_FILE": receivers[0].ca_file,
        "PALISADE_WEBHOOK_LOOPBACK_PORTS": ",".join(str(r.port) for r in receivers),
        **extra,
    }


def operator_of(serve):
    return serve.client("operator", headers={"Authorization": f"Bearer {serve.mint_operator_token()}"})


def create_webhook(operator, url: str, events: list[str]) -> tuple[str, str]:
    answer = operator.post("/api/v1/webhooks", json={"url": url, "events": events, "description": "e2e"})
    assert answer.status_code == 201, answer.text
    return answer.json()["record"]["id"], answer.json()["secret"]


def enrolled_agents(serve, operator, root, count: int):
    bundle = operator.post(
        "/api/v1/provisioning-tokens", json={"description": "webhooks", "max_uses": count}
    ).json()["bundle"]
    agents = []
    for n in range(count):
        enrol(bundle, str(root / f"agent-{n}"), hostname=f"agent-{n}", addresses=[f"10.70.0.{n + 1}"])
        agents.append(StateDir(root / f"agent-{n}").load_enrolment())
    return agents


def report_gaps(serve, agent, count: int, *, uptime: float) -> list[str]:
    """One flow report carrying `count` evidence gaps (an event each); returns their ids in order."""
    now = time.time()
    gaps = [
        {
            "id": str(uuid.uuid4()),
            "kind": "source_overrun",
            "source": "conntrack",
            "start": now - 50 + i,
            "end": now - 50 + i + 0.5,
            "lost": {},
        }
        for i in range(count)
    ]
    body = report_body([], gaps, now=now, process_start_id="e2e", uptime_seconds=uptime, window_seconds=60)
    answer = post_flow_report(serve, agent, body)
    assert answer.status_code == 200, answer.text
    assert {g["result"] for g in answer.json()["gaps"]} == {"accepted"}
    return [g["id"] for g in gaps]


def gap_events(receiver: Receiver) -> list[tuple[dict, dict]]:
    return [(h, p) for h, p in receiver.delivered() if p["type"] == "workload.evidence_gap"]


def gaps_counted(receiver: Receiver) -> int:
    """The gaps the delivered events stand for (a coalesced one says how many)."""
    return sum(p["data"].get("coalesced", {}).get("count", 1) for _, p in gap_events(receiver))


def happen(serve, agents, per_agent: int, per_report: int = 5) -> dict[str, list[str]]:
    """`per_agent` gap events for each agent, interleaved across agents; the ids per workload in order."""
    sent: dict[str, list[str]] = {a.identity.workload_id: [] for a in agents}
    for round in range(per_agent // per_report):
        for agent in agents:
            sent[agent.identity.workload_id] += report_gaps(serve, agent, per_report, uptime=100.0 + round)
    return sent


def assert_each_once_in_order(receiver: Receiver, sent: dict[str, list[str]]) -> None:
    """Gap events are coalesced per workload (a delivery stands for those it superseded, `coalesced`
    says how many): per workload, what arrived is in order, once, ends with the latest gap, and counts
    every gap sent exactly once."""
    events = gap_events(receiver)
    ids = Counter(h["webhook-id"] for h, _ in events)
    assert set(ids.values()) == {1}, [i for i, n in ids.items() if n > 1]  # each event once by id
    received: dict[str, list[tuple[str, int]]] = {}
    for _, payload in events:
        count = payload["data"].get("coalesced", {}).get("count", 1)
        received.setdefault(payload["data"]["workload"]["id"], []).append(
            (payload["data"]["gap"]["id"], count)
        )
    assert received.keys() == sent.keys()
    for workload_id, gap_ids in sent.items():
        got = received[workload_id]
        places = [gap_ids.index(gap_id) for gap_id, _ in got]
        assert places == sorted(set(places)), (workload_id, places)  # in order, each once
        assert got[-1][0] == gap_ids[-1]  # the latest arrives
        assert sum(count for _, count in got) == len(gap_ids)  # every gap counted, once


def test_a_receiver_failing_three_times_gets_the_event_once_it_answers_with_a_valid_signature(tmp_path):
    receiver = Receiver(tmp_path, fail_first=3).start()
    with Site.fresh(tmp_path / "data", migrated=True) as site:
        serve = site.serve(env=env_for(receiver))
        with operator_of(serve) as operator:
            webhook_id, secret = create_webhook(operator, receiver.url, ["webhook.created"])
            receiver.wait_for(lambda r: r.delivered())
            # The sender records the answer just after the receiver sent it: wait for the record.
            deadline = time.monotonic() + 10
            while (listed := operator.get(f"/api/v1/webhooks/{webhook_id}").json())["deliveries"]["pending"]:
                assert time.monotonic() < deadline, "the delivered attempt was not recorded"
                time.sleep(0.05)
            attempts = operator.get(f"/api/v1/webhooks/{webhook_id}/deliveries").json()["items"]
        assert serve.stop() == 0
        assert "Traceback" not in serve.stderr_text()
    receiver.stop()
    assert [status for _, _, status in receiver.requests] == [500, 500, 500, 200]
    assert len({h["webhook-id"] for h, _, _ in receiver.requests}) == 1  # one event, four attempts
    headers, body, _ = receiver.requests[-1]
    payload = Verifier(secret).verify(body, headers)
    assert payload["type"] == "webhook.created" and payload["data"]["webhook"]["id"] == webhook_id
    assert payload["id"] == headers["webhook-id"] and headers["webhook-id"].startswith("evt_")
    assert [(a["attempt"], a["status_code"], a["outcome"]) for a in reversed(attempts)] == [
        (1, 500, "retrying"),
        (2, 500, "retrying"),
        (3, 500, "retrying"),
        (4, 200, "delivered"),
    ]
    assert all(a["duration_ms"] >= 0 and a["event"]["id"] == payload["id"] for a in attempts)
    assert listed["deliveries"]["pending"] == 0 and "secret" not in listed


def test_serve_killed_between_the_state_change_and_the_delivery_delivers_after_restart(tmp_path):
    receiver = Receiver(tmp_path).start()
    with Site.fresh(tmp_path / "data", migrated=True) as site:
        # The first process never gets round to sending: its sender's first round is an hour away.
        slow = site.serve(env=env_for(receiver, PALISADE_WEBHOOK_SEND_EVERY_SECONDS="3600"))
        with operator_of(slow) as operator:
            webhook_id, secret = create_webhook(
                operator, receiver.url, ["webhook.created", "workload.evidence_gap"]
            )
            (agent,) = enrolled_agents(slow, operator, tmp_path, 1)
            gap_ids = report_gaps(slow, agent, 3, uptime=10.0)
            # The report's three gaps are one delivery standing for the three (coalesced).
            assert operator.get(f"/api/v1/webhooks/{webhook_id}").json()["deliveries"]["pending"] == 2
        slow.stop(signal.SIGKILL)
        assert receiver.requests == []

        serve = site.serve(env=env_for(receiver))
        receiver.wait_for(lambda r: len(r.delivered()) == 2)
        assert serve.stop() == 0
    receiver.stop()
    for headers, body, _ in receiver.requests:
        Verifier(secret).verify(body, headers)
    kinds = [p["type"] for _, p in receiver.delivered()]
    assert sorted(kinds) == ["webhook.created", "workload.evidence_gap"]
    ((_, gap),) = gap_events(receiver)
    assert gap["data"]["gap"]["id"] == gap_ids[-1] and gap["data"]["coalesced"]["count"] == 3


def test_a_receiver_down_while_100_events_happen_receives_them_all_afterwards_coalesced_in_order(tmp_path):
    receiver = Receiver(tmp_path)  # not listening yet: connections are refused
    with Site.fresh(tmp_path / "data", migrated=True) as site:
        serve = site.serve(env=env_for(receiver))
        with operator_of(serve) as operator:
            webhook_id, _ = create_webhook(operator, receiver.url, ["workload.evidence_gap"])
            agents = enrolled_agents(serve, operator, tmp_path, 4)
            sent = happen(serve, agents, per_agent=25)
            deadline = time.monotonic() + 30
            while not operator.get(f"/api/v1/webhooks/{webhook_id}/deliveries").json()["items"]:
                assert time.monotonic() < deadline, "no attempt was made while the receiver was down"
                time.sleep(0.1)
            failed = operator.get(f"/api/v1/webhooks/{webhook_id}/deliveries").json()["items"]
            assert failed[0]["status_code"] is None and "Refused" in failed[0]["error"]

            receiver.start()
            receiver.wait_for(lambda r: gaps_counted(r) >= 100, timeout=90)
            deadline = time.monotonic() + 30
            while operator.get(f"/api/v1/webhooks/{webhook_id}").json()["deliveries"]["pending"]:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert serve.stop() == 0
        assert "Traceback" not in serve.stderr_text()
    receiver.stop()
    assert sum(len(ids) for ids in sent.values()) == 100
    assert_each_once_in_order(receiver, sent)


@pytest.mark.postgres
def test_two_serve_processes_on_one_postgresql_send_each_event_once(tmp_path):
    require(
        bool(os.environ.get("DATABASE_URL")), "two serve processes share a PostgreSQL database (DATABASE_URL)"
    )
    receiver = Receiver(tmp_path, delay=0.01).start()
    with Site.fresh(tmp_path / "data", migrated=True) as site:
        env = env_for(receiver, PALISADE_WEBHOOK_SEND_EVERY_SECONDS="0.1")
        first, second = site.serve_together(2, env=env)
        with operator_of(first) as operator:
            webhook_id, _ = create_webhook(operator, receiver.url, ["workload.evidence_gap"])
            agents = enrolled_agents(first, operator, tmp_path, 4)
            # Reports reach both processes' gateways; both senders poll the same outbox.
            sent: dict[str, list[str]] = {a.identity.workload_id: [] for a in agents}
            for round in range(5):
                for n, agent in enumerate(agents):
                    serve = (first, second)[(n + round) % 2]
                    sent[agent.identity.workload_id] += report_gaps(serve, agent, 5, uptime=100.0 + round)
            receiver.wait_for(lambda r: gaps_counted(r) >= 100, timeout=90)
            # Nothing pending: no sender holds anything more to send (a duplicate would be in by now).
            deadline = time.monotonic() + 30
            while operator.get(f"/api/v1/webhooks/{webhook_id}").json()["deliveries"]["pending"]:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert first.stop() == 0 and second.stop() == 0
    receiver.stop()
    assert_each_once_in_order(receiver, sent)


@pytest.mark.alone
def test_a_slow_a_trickling_and_a_silent_receiver_delay_only_themselves(tmp_path):
    """Three receivers hold their first request (one answers only when let go, one trickles its answer a
    byte at a time, one never answers) until the healthy receiver beside them has every event: each
    webhook is delivered on its own. Their webhooks are created first, so a sender working one
    delivery after another would reach them first and wait on them (up to the 30 s timeout here)."""
    release = threading.Event()
    holding = [Receiver(tmp_path, holding=style, release=release).start() for style in HOLDING]
    healthy = Receiver(tmp_path).start()
    try:
        with Site.fresh(tmp_path / "data", migrated=True) as site:
            serve = site.serve(env=env_for(*holding, healthy, PALISADE_WEBHOOK_TIMEOUT_SECONDS="30"))
            with operator_of(serve) as operator:
                for receiver in (*holding, healthy):
                    create_webhook(operator, receiver.url, ["workload.evidence_gap"])
                agents = enrolled_agents(serve, operator, tmp_path, 3)
                sent = {a.identity.workload_id: report_gaps(serve, a, 1, uptime=10.0) for a in agents}
                healthy.wait_for(
                    lambda r: len(gap_events(r)) == 3, timeout=20, what="the healthy one's events"
                )
                # Each of the others still holds the first request it got, and got no other.
                assert [(r.held, r.done) for r in holding] == [(1, 0)] * 3
                release.set()
                for receiver in holding[:2]:  # the slow and the trickling one answer 200 once let go
                    receiver.wait_for(lambda r: r.done == 3, timeout=30, what="the held ones' answers")
            assert serve.stop() == 0
            assert "Traceback" not in serve.stderr_text()
    finally:
        release.set()
        for receiver in (*holding, healthy):
            receiver.stop()
    assert_each_once_in_order(healthy, sent)

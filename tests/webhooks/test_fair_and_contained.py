"""Webhooks fair and contained, in process: floods an agent can cause are coalesced per workload and
type, each webhook's backlog is capped, a receiver given up on has its backlog closed in bulk, a round
has a budget, serve's sender threads run one round per webhook at a time and never wait for a slow
one, and what a receiver answers is never stored (a status code and a reason of ours). Receivers are
this process's, on loopback; the others are scripted (`Recorder`), never reached."""

import http.server
import json
import socket
import threading
import time
import uuid
from datetime import timedelta

import pytest
from django.core.management import call_command

from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from controlplane.housekeeping import webhooks_cap_step
from controlplane.webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEvent
from controlplane.webhooks.sender import (
    SENDERS,
    Answer,
    webhook_deliveries_send,
    webhook_round,
    webhook_rounds_start,
)
from controlplane.webhooks.services import webhook_create
from fleet import sync
from flows.services import flow_report_ingest
from tests.support.flow_evidence import at_agent_clock, enrolled, golden
from tests.support.workloads import connect, make_workload

HOOK = "https://192.0.2.1/"  # never reached: these tests' sends are scripted


class Recorder:
    """A scripted transport: answers from a script per URL (200 once it runs out), records what was sent."""

    def __init__(self, script=None):
        self.script = script or {}
        self.sent: list[tuple[str, dict]] = []

    def __call__(self, url, *, body, headers, timeout):
        self.sent.append((url, json.loads(body)))
        answers = self.script.get(url, [])
        status = answers.pop(0) if answers else 200
        return Answer(status, "" if status and 200 <= status < 300 else "scripted failure", 3)


def subscribe(*types, url=HOOK):
    return webhook_create(actor=CLI_ACTOR, data={"url": url, "events": list(types)}).webhook


def report_gaps(workload, count: int, *, uptime: float) -> list[str]:
    """One flow report of `workload` carrying `count` evidence gaps; their ids in order."""
    now = clock.now()
    gaps = [
        {
            "id": str(uuid.uuid4()),
            "kind": "source_overrun",
            "source": "conntrack",
            "start": clock.rfc3339(now - timedelta(seconds=600 - i * 0.1)),
            "end": clock.rfc3339(now - timedelta(seconds=600 - i * 0.1 - 0.05)),
            "lost": {},
        }
        for i in range(count)
    ]
    report = at_agent_clock({**golden(), "windows": [], "gaps": gaps, "uptime_seconds": uptime}, now)
    outcome = flow_report_ingest(workload_id=str(workload.id), data=report)
    assert {g["result"] for g in outcome["gaps"]} == {"accepted"}
    return [g["id"] for g in gaps]


def test_a_flood_of_gaps_is_coalesced_per_workload_and_delays_no_other_workload(db):
    hook = subscribe("workload.evidence_gap")
    flooding, _, _ = enrolled("flooding", "10.50.0.1")
    other, _, _ = enrolled("other", "10.50.0.2")
    first = report_gaps(flooding, 500, uptime=100)
    # One report: one event and one delivery, standing for its 500 gaps.
    (delivery,) = WebhookDelivery.objects.all()
    assert delivery.coalesced_count == 500 and WebhookEvent.objects.count() == 1
    # Two more reports while that one waits: the later supersedes the earlier, which no sender holds.
    second = report_gaps(flooding, 300, uptime=101)
    third = report_gaps(flooding, 200, uptime=102)
    pending = WebhookDelivery.objects.filter(webhook=hook, state="pending").order_by("event_seq")
    assert [d.coalesced_count for d in pending] == [500, 500]
    assert WebhookDelivery.objects.filter(state="superseded").count() == 1
    (mine,) = report_gaps(other, 1, uptime=100)

    send = Recorder()
    assert webhook_deliveries_send(post=send) == 3
    bodies = [body for _, body in send.sent]
    assert [(b["data"]["gap"]["id"], b["data"].get("coalesced", {}).get("count")) for b in bodies] == [
        (first[-1], 500),
        (third[-1], 500),  # the second report's 300 and the third's 200
        (mine, None),  # a single event carries no count
    ]
    assert second[-1] not in {b["data"]["gap"]["id"] for b in bodies}
    superseded = WebhookDelivery.objects.get(state="superseded")
    assert bodies[1]["data"]["coalesced"]["since"] == clock.rfc3339(superseded.created_at)


def test_flapping_streams_and_tables_are_coalesced_per_workload_and_type(db):
    hook = subscribe("workload.offline", "workload.enforcement_removed", "workload.enforcement_restored")
    workload = connect(make_workload())
    for n in range(50):
        connect(workload, stream_id=f"s{n}")
        for state in ("absent", "present"):
            sync.workload_table_reported(workload_id=workload.id, stream_id=f"s{n}", state=state)
        sync.workload_stream_ended(workload_id=workload.id, stream_id=f"s{n}")
    pending = WebhookDelivery.objects.filter(webhook=hook, state="pending").order_by("event_seq")
    # The first one (a sender may be holding it), then one per type, the latest, with its count.
    assert [(d.event.type, d.coalesced_count) for d in pending] == [
        ("workload.enforcement_removed", 1),
        ("workload.enforcement_removed", 49),
        ("workload.enforcement_restored", 50),
        ("workload.offline", 50),
    ]


def test_operator_events_are_never_coalesced(db):
    from fleet.services import mode_change_create

    subscribe("mode_change.requested")
    make_workload()
    for mode in ("simulation", "enforced", "visibility"):
        mode_change_create(actor=CLI_ACTOR, data={"selection": {"all": True}, "mode": mode})
    assert list(WebhookDelivery.objects.values_list("coalesced_count", "state")) == [(1, "pending")] * 3


def offline_events(workloads):
    for workload in workloads:
        connect(workload, stream_id="s")
        sync.workload_stream_ended(workload_id=workload.id, stream_id="s")


def test_pending_deliveries_over_the_cap_are_given_up_oldest_first_with_the_reason(api, settings):
    capped = subscribe("workload.offline")
    offline_events([make_workload() for _ in range(5)])
    other = subscribe("workload.offline", url="https://192.0.2.2/")
    offline_events([make_workload() for _ in range(3)])
    oldest = list(WebhookDelivery.objects.filter(webhook=capped).order_by("event_seq")[:3])
    settings.PALISADE_WEBHOOK_MAX_PENDING = 8
    assert webhooks_cap_step() == 0  # at the cap is within it
    settings.PALISADE_WEBHOOK_MAX_PENDING = 5
    assert webhooks_cap_step() == 3
    assert {d.id for d in WebhookDelivery.objects.filter(webhook=capped, state="gave_up")} == {
        d.id for d in oldest
    }
    assert WebhookDelivery.objects.filter(webhook=capped, state="pending").count() == 5
    assert WebhookDelivery.objects.filter(webhook=other, state="pending").count() == 3  # under the cap
    listed = api.get(f"/api/v1/webhooks/{capped.id}/deliveries").json()["items"]
    assert len(listed) == 3 and {a["outcome"] for a in listed} == {"gave_up"}
    assert {(a["attempt"], a["status_code"], a["duration_ms"]) for a in listed} == {(0, None, 0)}
    assert {a["error"] for a in listed} == {
        "given up unsent: over 5 pending deliveries to this webhook, the oldest go"
    }
    assert webhooks_cap_step() == 0


def test_a_receiver_given_up_on_has_its_backlog_closed_in_bulk(db, settings, clock_at):
    settings.PALISADE_WEBHOOK_RETRY_BASE_SECONDS = 3600
    dead = subscribe("workload.offline", url="https://192.0.2.2/")
    alive = subscribe("workload.offline", url="https://192.0.2.3/")
    offline_events([make_workload() for _ in range(30)])
    refused = Recorder()

    def post(url, **kwargs):
        if url == "https://192.0.2.2/":
            refused.sent.append((url, json.loads(kwargs["body"])))
            return Answer(None, "ConnectionRefusedError: Connection refused", 1)
        return Answer(200, "", 1)

    assert webhook_deliveries_send(post=post) == 31  # the dead one's first, the live one's thirty
    clock_at(timedelta(hours=25))
    offline_events([make_workload()])  # news after the give-up period: not closed with the rest
    WebhookDelivery.objects.filter(webhook=dead, state="pending").update(next_attempt_at=clock.now())
    assert webhook_deliveries_send(post=post) == 2  # one attempt to the dead one gives up all it owed
    states = {
        s: WebhookDelivery.objects.filter(webhook=dead, state=s).count() for s in ("gave_up", "pending")
    }
    assert states == {"gave_up": 30, "pending": 1} and len(refused.sent) == 2
    closed = WebhookAttempt.objects.filter(webhook_id=dead.id, number=0)
    assert closed.count() == 29 and {a.outcome for a in closed} == {"gave_up"}
    assert {a.error for a in closed} == {
        "given up with the rest: the receiver failed past the give-up period "
        "(ConnectionRefusedError: Connection refused)"
    }
    assert not WebhookDelivery.objects.filter(webhook=alive).exclude(state="delivered").exists()


def test_a_round_starts_no_attempt_after_its_budget(db):
    hook = subscribe("workload.offline")
    offline_events([make_workload() for _ in range(10)])

    def slow(url, **kwargs):
        time.sleep(0.3)
        return Answer(200, "", 300)

    attempted = webhook_round(webhook_id=hook.id, post=slow, budget_seconds=1.0)
    assert 1 <= attempted <= 4
    assert WebhookDelivery.objects.filter(state="pending").count() == 10 - attempted
    assert webhook_round(webhook_id=hook.id, post=lambda url, **_: Answer(200, "", 1)) == 10 - attempted


@pytest.mark.postgres
def test_serve_s_sender_threads_run_a_round_per_webhook_at_once_and_never_two_for_one(transactional_db):
    """While one webhook's round waits on its receiver, another webhook's round delivers, and the
    step started again queues nothing more for the waiting one."""
    from django.db import connection

    from tests.support.requirements import require

    require(connection.vendor == "postgresql", "concurrent rounds: PostgreSQL (SQLite runs one writer)")
    slow, fast = subscribe("workload.offline"), subscribe("workload.offline", url="https://192.0.2.2/")
    offline_events([make_workload() for _ in range(3)])
    release, waiting = threading.Event(), threading.Event()

    def post(url, **kwargs):
        if url == HOOK:
            waiting.set()
            release.wait(30)
        return Answer(200, "", 1)

    try:
        assert webhook_rounds_start(post=post) == 2
        assert waiting.wait(10)
        deadline = time.monotonic() + 10
        # The other webhook's round delivers everything and ends while this one's still waits.
        while WebhookDelivery.objects.filter(webhook=fast, state="pending").exists() or SENDERS.busy() != {
            slow.id
        }:
            assert time.monotonic() < deadline, "the other webhook's round did not deliver and end"
            time.sleep(0.05)
        assert webhook_rounds_start(post=post) == 0  # its round is running: none queued beside it
        assert WebhookDelivery.objects.filter(webhook=slow, state="delivered").count() == 0
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while SENDERS.busy():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert WebhookDelivery.objects.filter(webhook=slow, state="delivered").count() == 3


SECRET = "hunter2-secret-in-the-answer"


class _Telling(http.server.BaseHTTPRequestHandler):
    """Answers with text that must never be stored: a body, a header, a Location."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        body = f"<h1>Error</h1><pre>DATABASE_PASSWORD={SECRET}</pre>".encode()
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"https://internal.example/{SECRET}")
        else:
            self.send_response(500, f"Failed {SECRET}")
        self.send_header("X-Debug", SECRET)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def banner_server(banner: bytes) -> socket.socket:
    """A TCP service on loopback that speaks first (an SSH server's banner) and is not HTTP."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(banner)
                try:
                    conn.recv(65536)
                    conn.sendall(banner)
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_a_delivery_records_a_status_code_and_a_reason_of_ours_never_the_receiver_s_text(
    api, settings, capsys
):
    telling = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Telling)
    threading.Thread(target=telling.serve_forever, daemon=True).start()
    ssh = banner_server(f"SSH-2.0-OpenSSH_9.2p1 {SECRET}\r\n".encode())
    port, ssh_port = telling.server_address[1], ssh.getsockname()[1]
    settings.PALISADE_WEBHOOK_LOOPBACK_PORTS = (port, ssh_port)
    try:
        hooks = {
            path: subscribe("webhook.created", url=url)
            for path, url in {
                "error": f"http://127.0.0.1:{port}/error",
                "redirect": f"http://127.0.0.1:{port}/redirect",
                "banner": f"http://127.0.0.1:{ssh_port}/",
                "tls-to-plain": f"https://127.0.0.1:{ssh_port}/",
            }.items()
        }
        webhook_deliveries_send()
    finally:
        telling.shutdown()
        telling.server_close()
        ssh.close()
    stored = {
        path: list(WebhookAttempt.objects.filter(webhook_id=hook.id).values_list("status_code", "error"))
        for path, hook in hooks.items()
    }
    assert {path: attempts[0] for path, attempts in stored.items()} == {
        "error": (500, "HTTP 500"),
        "redirect": (302, "redirect not followed"),
        "banner": (None, "not an HTTP answer"),
        "tls-to-plain": (None, "TLS handshake failed"),
    }
    shown = [api.get(f"/api/v1/webhooks/{hook.id}/deliveries").content.decode() for hook in hooks.values()]
    for hook in hooks.values():
        call_command("webhook", "deliveries", str(hook.id))
    shown.append(capsys.readouterr().out)
    assert not any(SECRET in text or "OpenSSH" in text for text in shown)


def test_old_attempts_keep_no_receiver_text_after_the_migration(db):
    import importlib

    from django.apps import apps

    migration = importlib.import_module("controlplane.webhooks.migrations.0003_coalescing_and_reasons")
    hook = subscribe("webhook.created")
    delivery = WebhookDelivery.objects.get()
    old = [
        (503, "HTTP 503: <html>password=x</html>"),
        (302, "redirect not followed (Location: https://internal/secret)"),
        (None, "BadStatusLine: SSH-2.0-OpenSSH_9.2p1 Debian"),
        (None, "ConnectionRefusedError: [Errno 111] Connection refused"),
        (None, "no answer within 10 s"),
        (None, "<weird text: from somewhere>"),
    ]
    for n, (status, error) in enumerate(old, 1):
        WebhookAttempt.objects.create(
            delivery=delivery, webhook_id=hook.id, event_id="evt_x", event_type="webhook.created", number=n,
            at=clock.now(), duration_ms=1, status_code=status, error=error, outcome="retrying",
        )  # fmt: skip
    migration.scrub(apps, None)
    assert list(WebhookAttempt.objects.order_by("number").values_list("error", flat=True)) == [
        "HTTP 503",
        "redirect not followed",
        "BadStatusLine",
        "ConnectionRefusedError",
        "no answer within 10 s",
        "no HTTP answer",
    ]

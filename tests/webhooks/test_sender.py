"""The sender in process: order per workload, the backoff schedule and giving up, and real HTTP
attempts against a receiver in this process (signature, redirects refused, bounded time)."""

import http.server
import random
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import pytest
from standardwebhooks.webhooks import Webhook as Verifier

from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from controlplane.webhooks.models import WebhookAttempt, WebhookDelivery
from controlplane.webhooks.sender import Answer, http_post, retry_delay, webhook_deliveries_send
from controlplane.webhooks.services import webhook_create
from fleet import sync
from tests.support.workloads import connect, make_workload


def test_full_jitter_backoff_grows_exponentially_to_its_cap():
    rng = random.Random(7)
    for attempts in range(1, 30):
        ceiling = min(3600, 5 * 2 ** (attempts - 1))
        draws = [retry_delay(attempts, base=5, cap=3600, rng=rng) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in draws)
        assert max(draws) > ceiling * 0.9  # spread over the whole range: full jitter, not a fixed step
    assert retry_delay(10_000, base=5, cap=3600, rng=rng) <= 3600  # no overflow however many attempts


class Recorder:
    """A fake transport: answers from a script per URL, records what was sent."""

    def __init__(self, script=None):
        self.script = script or {}
        self.sent = []

    def __call__(self, url, *, body, headers, timeout):
        self.sent.append((url, headers["webhook-id"], body))
        answers = self.script.get(url, [])
        status = answers.pop(0) if answers else 200
        return Answer(status, "" if 200 <= status < 300 else f"HTTP {status}", 3)


def offline_events(workloads, rounds):
    """`rounds` offline events per workload, interleaved."""
    for _ in range(rounds):
        for workload in workloads:
            connect(workload, stream_id="s")
            sync.workload_stream_ended(workload_id=workload.id, stream_id="s")


def test_events_of_a_workload_wait_for_the_one_before_them_and_other_workloads_do_not(db, settings):
    settings.PALISADE_WEBHOOK_RETRY_BASE_SECONDS = 600
    hook = webhook_create(
        actor=CLI_ACTOR, data={"url": "https://192.0.2.1/", "events": ["workload.offline"]}
    ).webhook
    one, two = make_workload(), make_workload()
    offline_events([one, two], rounds=3)
    send = Recorder({"https://192.0.2.1/": [500]})  # the very first attempt fails

    def keys_sent():
        keys = [WebhookDelivery.objects.get(event__id=event_id).order_key for _, event_id, _ in send.sent]
        send.sent.clear()
        return keys

    webhook_deliveries_send(post=send)
    assert keys_sent() == [str(one.id)]  # and the round stops trying a failing webhook
    webhook_deliveries_send(post=send)  # one's first waits for its retry; one's later events wait for it
    # Offline events are coalesced: each workload's third superseded its second, waiting behind the first.
    assert keys_sent() == [str(two.id)] * 2
    WebhookDelivery.objects.filter(webhook=hook, state="pending").update(next_attempt_at=clock.now())
    webhook_deliveries_send(post=send)
    assert keys_sent() == [str(one.id)] * 2
    delivered = WebhookDelivery.objects.filter(state="delivered")
    assert delivered.count() == 4 and WebhookDelivery.objects.filter(state="superseded").count() == 2
    assert sorted(delivered.values_list("coalesced_count", flat=True)) == [1, 1, 2, 2]
    by_key = {}
    for delivery in delivered.order_by("finished_at", "id"):
        by_key.setdefault(delivery.order_key, []).append(delivery.event_seq)
    assert all(seqs == sorted(seqs) for seqs in by_key.values())


def test_a_delivery_failing_past_the_give_up_period_is_given_up_with_the_rest_and_a_new_one_goes(
    db, settings, clock_at
):
    settings.PALISADE_WEBHOOK_RETRY_BASE_SECONDS = 1
    settings.PALISADE_WEBHOOK_RETRY_CAP_SECONDS = 3600
    webhook_create(actor=CLI_ACTOR, data={"url": "https://192.0.2.2/", "events": ["workload.offline"]})
    workload = make_workload()
    offline_events([workload], rounds=2)
    send = Recorder({"https://192.0.2.2/": [503] * 1000})
    elapsed = timedelta(0)
    while elapsed <= timedelta(hours=24):
        webhook_deliveries_send(post=send)
        step = timedelta(hours=1)
        clock_at(step)
        elapsed += step
    first = WebhookDelivery.objects.order_by("event_seq").first()
    assert first.state == "gave_up" and first.attempts >= 20  # retried all along, at most an hour apart
    outcomes = list(
        WebhookAttempt.objects.filter(delivery=first).order_by("id").values_list("outcome", flat=True)
    )
    assert outcomes[-1] == "gave_up" and set(outcomes[:-1]) == {"retrying"}
    second = WebhookDelivery.objects.order_by("event_seq").last()  # past its give-up period too
    assert second.state == "gave_up" and second.attempts == 0
    (closed,) = WebhookAttempt.objects.filter(delivery=second)
    assert (closed.number, closed.outcome, closed.status_code) == (0, "gave_up", None)
    assert closed.error.startswith("given up with the rest: the receiver failed past the give-up period")
    send.script = {}
    offline_events([workload], rounds=1)
    webhook_deliveries_send(post=send)
    assert WebhookDelivery.objects.order_by("event_seq").last().state == "delivered"


class _Receiver(http.server.BaseHTTPRequestHandler):
    answers: list = []
    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((self.path, dict(self.headers), body))
        status, headers, delay = type(self).answers.pop(0) if type(self).answers else (204, {}, 0)
        time.sleep(delay)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@contextmanager
def receiver(settings, answers=()):
    """A plain http receiver on loopback, its port listed as admitted (PALISADE_WEBHOOK_LOOPBACK_PORTS)."""
    handler = type("Receiver", (_Receiver,), {"answers": list(answers), "received": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    settings.PALISADE_WEBHOOK_LOOPBACK_PORTS = (server.server_address[1],)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_a_real_delivery_is_signed_the_standard_webhooks_way(db, settings):
    with receiver(settings) as (url, handler):
        created = webhook_create(
            actor=CLI_ACTOR, data={"url": f"{url}/hook?x=1", "events": ["webhook.created"]}
        )
        assert webhook_deliveries_send() == 1
    ((path, headers, body),) = handler.received
    assert path == "/hook?x=1" and headers["Content-Type"] == "application/json"
    payload = Verifier(created.secret).verify(body, headers)
    assert payload["type"] == "webhook.created" and payload["id"] == headers["webhook-id"]
    assert payload["data"]["webhook"]["id"] == str(created.webhook.id)
    with pytest.raises(Exception, match="signature"):
        Verifier(created.secret).verify(body.replace(b"created", b"deleted"), headers)
    (attempt,) = WebhookAttempt.objects.all()
    assert (attempt.status_code, attempt.outcome) == (204, "delivered")


def test_a_redirect_is_a_failure_and_is_not_followed(settings):
    with receiver(settings, [(302, {"Location": "/elsewhere"}, 0)]) as (url, handler):
        answer = http_post(f"{url}/hook", body=b"{}", headers={}, timeout=5)
    assert not answer.delivered and answer.status_code == 302
    assert answer.error == "redirect not followed"  # the Location is the receiver's text: not kept
    assert [path for path, _, _ in handler.received] == ["/hook"]  # /elsewhere never asked


def test_an_attempt_is_bounded_in_time(settings):
    with receiver(settings, [(200, {}, 3)]) as (url, _):
        started = time.monotonic()
        answer = http_post(url, body=b"{}", headers={}, timeout=0.5)
        took = time.monotonic() - started
    assert not answer.delivered and "0.5 s" in answer.error and took < 2


def test_a_refused_connection_is_a_failure_with_its_reason(settings):
    with receiver(settings) as (url, _):
        pass  # closed again: nothing listens there now
    answer = http_post(url, body=b"{}", headers={}, timeout=2)
    assert answer.status_code is None and "ConnectionRefused" in answer.error


def test_a_tls_handshake_that_never_completes_is_bounded_too(settings):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # connects (the backlog), never answers
        settings.PALISADE_WEBHOOK_LOOPBACK_PORTS = (silent.getsockname()[1],)
        started = time.monotonic()
        answer = http_post(
            f"https://127.0.0.1:{silent.getsockname()[1]}/", body=b"{}", headers={}, timeout=0.5
        )
        took = time.monotonic() - started
    assert not answer.delivered and answer.status_code is None and took < 2


@pytest.mark.postgres
def test_deleting_a_webhook_while_its_delivery_is_in_flight_waits_for_it_and_both_succeed(transactional_db):
    from django.db import connection, connections

    from controlplane.webhooks.models import Webhook
    from controlplane.webhooks.services import webhook_delete
    from tests.support.requirements import require

    require(connection.vendor == "postgresql", "row locks: PostgreSQL")
    created = webhook_create(
        actor=CLI_ACTOR, data={"url": "https://192.0.2.4/", "events": ["webhook.created"]}
    )
    sending, release = threading.Event(), threading.Event()
    outcome = {}

    def post(url, *, body, headers, timeout):
        sending.set()
        release.wait(10)
        return Answer(200, "", 5)

    def sender():
        try:
            outcome["sent"] = webhook_deliveries_send(post=post)
        except Exception as error:  # noqa: BLE001 - reported below
            outcome["sent"] = error
        finally:
            connections.close_all()

    thread = threading.Thread(target=sender)
    thread.start()
    assert sending.wait(10)
    deleting = threading.Thread(
        target=lambda: (
            outcome.setdefault(
                "deleted", webhook_delete(actor=CLI_ACTOR, webhook_id=str(created.webhook.id))
            ),
            connections.close_all(),
        )
    )
    deleting.start()
    deleting.join(0.5)
    assert deleting.is_alive()  # waits for the attempt in flight
    release.set()
    thread.join(10)
    deleting.join(10)
    assert outcome["sent"] == 1 and not Webhook.objects.exists()
    assert not WebhookDelivery.objects.exists() and not WebhookAttempt.objects.exists()


def test_finished_deliveries_are_pruned_after_their_retention_and_pending_ones_never(db, clock_at):
    from controlplane.housekeeping import webhooks_prune_step
    from controlplane.webhooks.models import WebhookEvent

    webhook_create(actor=CLI_ACTOR, data={"url": "https://192.0.2.1/", "events": ["workload.offline"]})
    webhook_create(actor=CLI_ACTOR, data={"url": "https://192.0.2.2/", "events": ["workload.offline"]})
    offline_events([make_workload()], rounds=1)
    webhook_deliveries_send(post=Recorder({"https://192.0.2.2/": [503]}))
    assert list(WebhookDelivery.objects.order_by("webhook__url").values_list("state", flat=True)) == [
        "delivered",
        "pending",
    ]
    clock_at(timedelta(days=6))
    assert webhooks_prune_step() == 0
    clock_at(timedelta(days=2))
    assert webhooks_prune_step() > 0
    (left,) = WebhookDelivery.objects.all()
    assert left.state == "pending" and WebhookEvent.objects.filter(seq=left.event_seq).exists()
    assert set(WebhookAttempt.objects.values_list("delivery_id", flat=True)) == {left.id}


def test_a_receiver_that_does_not_answer_holds_back_its_own_deliveries_and_nobody_else_s(db, settings):
    settings.PALISADE_WEBHOOK_RETRY_BASE_SECONDS = 600
    for url in ("https://192.0.2.2/", "https://192.0.2.3/"):
        webhook_create(actor=CLI_ACTOR, data={"url": url, "events": ["workload.offline"]})
    offline_events([make_workload() for _ in range(4)], rounds=1)
    calls = []

    def post(url, *, body, headers, timeout):
        calls.append(url)
        if url == "https://192.0.2.2/":
            return Answer(None, "ConnectionRefusedError: refused", 1)
        return Answer(200, "", 1)

    webhook_deliveries_send(post=post)
    webhook_deliveries_send(post=post)  # the next round: the down receiver's other heads wait too
    assert calls.count("https://192.0.2.2/") == 1 and calls.count("https://192.0.2.3/") == 4
    down = WebhookDelivery.objects.filter(webhook__url="https://192.0.2.2/")
    assert down.filter(state="pending").count() == 4 and down.filter(attempts=0).count() == 3
    (retry_at,) = set(down.values_list("next_attempt_at", flat=True))  # all on the failed one's retry
    assert retry_at > clock.now()

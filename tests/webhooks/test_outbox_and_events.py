"""Webhooks in process: the API and its audit, the outbox written in the transaction of each state
change that causes an event (and not at all when it rolls back), and the events' shapes."""

import uuid
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import transaction

from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from controlplane.models import AuditEvent
from controlplane.webhooks.models import Webhook, WebhookDelivery, WebhookEvent, WebhookWatermark
from controlplane.webhooks.outbox import EVENT_TYPES, FLEET_ORDER, fleet_events_turn, webhook_event_record
from controlplane.webhooks.services import webhook_create
from fleet import sync
from fleet.credentials import credential_expiries_notice, credential_renewal_failed
from fleet.services import mode_change_create
from flows.services import flow_report_ingest
from tests.support.flow_evidence import at_agent_clock, enrolled, golden
from tests.support.helpers import assert_problem
from tests.support.workloads import connect, make_workload


def subscribe(*types, url="https://192.0.2.10/palisade"):
    return webhook_create(actor=CLI_ACTOR, data={"url": url, "events": list(types or EVENT_TYPES)}).webhook


def events_of(type):
    return list(WebhookEvent.objects.filter(type=type).order_by("seq"))


@pytest.mark.parametrize(
    "url",
    [
        "https://192.0.2.10/a?b=c",
        "http://127.0.0.1:9000/hook",
        "http://127.1.2.3/hook",
        "http://[::1]:9000/hook",
        "http://localhost:9000/hook",
    ],
)
def test_https_anywhere_and_plain_http_only_to_loopback(api, settings, url):
    settings.PALISADE_WEBHOOK_LOOPBACK_PORTS = (9000, 80)  # loopback receivers: only on listed ports
    answer = api.post("/api/v1/webhooks", {"url": url, "events": ["workload.degraded"]}, format="json")
    assert answer.status_code == 201, answer.content


@pytest.mark.parametrize(
    "body, path, rule",
    [
        ({"url": "http://192.0.2.10/a", "events": ["workload.degraded"]}, "/url", "url-scheme"),
        ({"url": "http://10.0.0.1/a", "events": ["workload.degraded"]}, "/url", "url-scheme"),
        ({"url": "ftp://192.0.2.10/a", "events": ["workload.degraded"]}, "/url", "url"),
        ({"url": "https:///nohost", "events": ["workload.degraded"]}, "/url", "url"),
        ({"url": "https://u:p@192.0.2.10/", "events": ["workload.degraded"]}, "/url", "url"),
        ({"url": "https://192.0.2.10/", "events": []}, "/events", "empty"),
        ({"url": "https://192.0.2.10/", "events": ["workload.sneezed"]}, "/events/0", "event-type"),
        ({"url": "https://192.0.2.10/"}, "/events", "required"),
        (
            {"url": "https://192.0.2.10/", "events": ["workload.degraded"], "secret": "x"},
            "/secret",
            "unknown-field",
        ),
    ],
)
def test_bad_webhooks_are_refused_with_findings_and_nothing_is_written(api, body, path, rule):
    answer = api.post("/api/v1/webhooks", body, format="json")
    assert_problem(answer, 422, "validation")
    assert (path, rule) in [(e["path"], e["rule"]) for e in answer.json()["errors"]]
    assert not Webhook.objects.exists() and not AuditEvent.objects.filter(object_type="webhook").exists()


def test_the_secret_is_shown_once_and_writes_are_audited_and_are_events(api):
    watcher = subscribe("webhook.created", "webhook.deleted")
    created = api.post(
        "/api/v1/webhooks",
        {"url": "https://192.0.2.10/x", "events": ["webhook.created"], "description": "pager"},
        format="json",
    )
    assert created.status_code == 201
    secret, record = created.json()["secret"], created.json()["record"]
    assert secret.startswith("whsec_") and len(secret) > 40
    shown = api.get(f"/api/v1/webhooks/{record['id']}").json()
    assert "secret" not in shown and secret not in str(api.get("/api/v1/webhooks").content)
    assert shown["deliveries"] == {
        "pending": 1,
        "oldest_pending_since": shown["deliveries"]["oldest_pending_since"],
    }
    # The new webhook's own creation is its first delivery (a first event to check the receiver).
    (event,) = [e for e in events_of("webhook.created") if e.data["webhook"]["id"] == record["id"]]
    assert set(WebhookDelivery.objects.filter(event=event).values_list("webhook_id", flat=True)) == {
        watcher.id,
        uuid.UUID(record["id"]),
    }
    assert secret not in str(event.data)

    assert api.delete(f"/api/v1/webhooks/{record['id']}").status_code == 200
    assert_problem(api.get(f"/api/v1/webhooks/{record['id']}"), 404, "not-found")
    assert_problem(api.delete(f"/api/v1/webhooks/{record['id']}"), 404, "not-found")
    (deleted,) = events_of("webhook.deleted")
    assert deleted.data["webhook"]["origin"] == "https://192.0.2.10"  # never a path's secret
    assert list(WebhookDelivery.objects.filter(event=deleted).values_list("webhook_id", flat=True)) == [
        watcher.id
    ]
    actions = list(
        AuditEvent.objects.filter(object_id=record["id"]).order_by("id").values_list("action", flat=True)
    )
    assert actions == ["webhook.create", "webhook.delete"]
    assert secret not in str(list(AuditEvent.objects.values_list("detail", flat=True)))


def test_a_webhook_created_later_gets_no_older_events(db):
    workload = connect(make_workload())
    first = subscribe("workload.offline")
    sync.workload_stream_ended(workload_id=workload.id, stream_id="stream-1")
    later = subscribe("workload.offline")
    (event,) = events_of("workload.offline")
    assert list(WebhookDelivery.objects.filter(event=event).values_list("webhook_id", flat=True)) == [
        first.id
    ]
    assert not WebhookDelivery.objects.filter(webhook=later).exists()


def test_an_event_nobody_subscribes_to_is_not_written(db):
    subscribe("workload.degraded")
    workload = connect(make_workload())
    sync.workload_stream_ended(workload_id=workload.id, stream_id="stream-1")
    assert not WebhookEvent.objects.exists()


def test_a_rolled_back_state_change_leaves_no_event(db):
    subscribe()
    workload = connect(make_workload())
    with pytest.raises(RuntimeError), transaction.atomic():
        sync.workload_apply_failed(
            workload_id=workload.id, stream_id="stream-1", version=workload.latest_policy_id, error="boom"
        )
        assert events_of("workload.degraded")  # written inside the transaction...
        raise RuntimeError("the caller's transaction fails after the change")
    assert not events_of("workload.degraded")  # ... and gone, with its deliveries
    assert not WebhookDelivery.objects.exclude(event__type="webhook.created").exists()
    workload.refresh_from_db()
    assert workload.sync_state == "pending"


def test_the_outbox_refuses_to_record_outside_a_transaction(transactional_db):
    subscribe()
    with pytest.raises(RuntimeError, match="inside the transaction"):
        webhook_event_record("webhook.created", {})


def test_the_fleet_order_lock_is_held_even_when_its_row_is_missing(db):
    """A flushed database has no fleet order row: the turn must make it and lock it, since locking no
    row would let a later-numbered fleet event commit before an earlier one."""
    WebhookWatermark.objects.filter(name=FLEET_ORDER).delete()
    with transaction.atomic():
        fleet_events_turn()
        assert WebhookWatermark.objects.select_for_update().filter(name=FLEET_ORDER).exists()


def test_workload_state_changes_are_events(db, clock_at):
    subscribe()
    workload = connect(make_workload(hostname="db-1", labels={"app": "db"}))
    sync.workload_apply_failed(
        workload_id=workload.id, stream_id="stream-1", version=workload.latest_policy_id, error="nft: syntax"
    )
    sync.workload_apply_failed(  # already degraded: no second event
        workload_id=workload.id, stream_id="stream-1", version=workload.latest_policy_id, error="nft: syntax"
    )
    (degraded,) = events_of("workload.degraded")
    assert degraded.workload_id == workload.id and degraded.id.startswith("evt_")
    assert degraded.data == {
        "workload": {"id": str(workload.id), "hostname": "db-1", "labels": {"app": "db"}},
        "was": "pending",
        "version": workload.latest_policy_id,
        "error": "nft: syntax",
    }

    for state in ("present", "absent", "absent", "present"):
        sync.workload_table_reported(workload_id=workload.id, stream_id="stream-1", state=state)
    assert len(events_of("workload.enforcement_removed")) == 1
    assert len(events_of("workload.enforcement_restored")) == 1

    clock_at(timedelta(minutes=5))
    assert sync.workload_streams_reap(silent_for=timedelta(minutes=3)) == 1
    (offline,) = events_of("workload.offline")
    assert 299 <= offline.data["silent_seconds"] <= 301 and offline.data["last_heard_from"]

    credential_renewal_failed(workload_id=str(workload.id), error="clock")
    credential_renewal_failed(workload_id=str(workload.id), error="clock")  # the same spell: once
    (failed,) = events_of("workload.credential_renewal_failed")
    assert failed.data["error"] == "clock" and failed.data["credential_serial"] == 1

    intent = mode_change_create(actor=CLI_ACTOR, data={"selection": {"all": True}, "mode": "enforced"})
    (requested,) = events_of("mode_change.requested")
    assert requested.workload_id is None
    assert requested.data["mode_change"]["id"] == str(intent.id)
    assert requested.data["mode_change"]["changed_workload_ids"] == [str(workload.id)]


def test_a_credential_expiry_is_an_event_once(db, clock_at):
    subscribe("workload.credential_expired")
    assert credential_expiries_notice() == 0  # the first round sets the watermark
    workload = make_workload()
    clock_at(timedelta(days=29))
    assert credential_expiries_notice() == 0
    clock_at(timedelta(days=2))
    assert credential_expiries_notice() == 1
    assert credential_expiries_notice() == 0
    (expired,) = events_of("workload.credential_expired")
    assert expired.data["workload"]["id"] == str(workload.id) and expired.data["revoked"] is False


def test_evidence_gaps_and_clock_skew_from_a_flow_report_are_events(db):
    subscribe("workload.evidence_gap", "workload.clock_skew")
    workload, _, _ = enrolled()
    report = at_agent_clock(golden(), clock.now() + timedelta(minutes=10))  # ten windows ahead
    flow_report_ingest(workload_id=str(workload.id), data=report)
    (gap,) = events_of("workload.evidence_gap")
    assert gap.data["gap"] == {
        "id": "0b1c2d3e-4f5a-4b6c-8d7e-9f0a1b2c3d4e",
        "kind": "source_overrun",
        "source": "conntrack",
        "start": "2027-01-15T08:00:20.000000Z",
        "end": "2027-01-15T08:00:20.500000Z",
        "lost": {},
    }
    (skew,) = events_of("workload.clock_skew")
    assert 590 <= skew.data["offset_seconds"] <= 610
    flow_report_ingest(workload_id=str(workload.id), data=report)  # a re-send: stored once, no news
    assert len(events_of("workload.evidence_gap")) == 1 and len(events_of("workload.clock_skew")) == 1


def test_the_host_command_creates_lists_and_deletes(db, capsys):
    call_command("webhook", "create", "--url", "https://192.0.2.10/c", "--event", "all")
    out = capsys.readouterr().out
    assert out.startswith("whsec_")
    (webhook,) = Webhook.objects.all()
    assert webhook.events == list(EVENT_TYPES)
    call_command("webhook", "list")
    assert str(webhook.id) in capsys.readouterr().out
    call_command("webhook", "deliveries", str(webhook.id))
    assert "1 pending" in capsys.readouterr().out
    call_command("webhook", "delete", str(webhook.id))
    assert not Webhook.objects.exists()
    assert AuditEvent.objects.filter(action="webhook.delete", actor_kind="cli").exists()

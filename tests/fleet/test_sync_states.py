"""Every row of the spec's sync-state table, the owned-table reports, Reconnecting and
enforcement-removed, and resend-snapshot."""

from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from controlplane import clock
from controlplane.housekeeping import streams_reap_step
from controlplane.problems import Problem
from fleet import sync
from fleet.models import Workload
from fleet.push import stream_group
from fleet.rendering import workloads_rerender
from tests.support.helpers import assert_problem
from tests.support.workloads import connect, make_workload


def state(workload):
    workload.refresh_from_db()
    return workload.sync_state


@pytest.fixture
def enforced_peerless(db):
    return make_workload(labels={"app": "web"}, mode="simulation")


def bump_latest(workload):
    """Render a new latest version for the workload (a mode change is the simplest way)."""
    Workload.objects.filter(id=workload.id).update(
        mode="enforced" if workload.mode != "enforced" else "simulation"
    )
    workloads_rerender(workload_ids=[str(workload.id)])
    workload.refresh_from_db()


def test_new_workload_is_offline_and_never_connected(api, db):
    workload = make_workload()
    body = api.get(f"/api/v1/workloads/{workload.id}").json()
    assert body["sync"]["state"] == "offline"
    assert body["sync"]["never_connected"] is True and body["sync"]["last_heard_from"] is None
    assert body["mode"] == "visibility" and body["latest_version"].startswith("sha256:")


def test_offline_stream_begins_pending_and_snapshot_time_moves(db):
    workload = make_workload()
    assert workload.last_snapshot_sent_at is None
    workload = connect(workload)
    assert workload.sync_state == "pending"
    assert workload.last_snapshot_sent_at is not None and workload.last_heard_from is not None


def test_pending_acknowledgement_of_latest_is_synced(db):
    workload = connect(make_workload())
    sync.workload_applied(workload_id=workload.id, stream_id="stream-1", version="sha256:old")
    assert state(workload) == "pending"  # an older version is not the latest
    sync.workload_applied(workload_id=workload.id, stream_id="stream-1", version=workload.latest_policy_id)
    assert state(workload) == "synced"
    assert workload.applied_version == workload.latest_policy_id


@pytest.mark.parametrize("start", ["pending", "synced"])
def test_failure_of_latest_is_degraded_with_the_error(api, db, start):
    workload = connect(make_workload())
    if start == "synced":
        sync.workload_applied(
            workload_id=workload.id, stream_id="stream-1", version=workload.latest_policy_id
        )
    sync.workload_apply_failed(
        workload_id=workload.id, stream_id="stream-1", version="sha256:other", error="x"
    )
    assert state(workload) == start  # a failure of another version changes nothing
    sync.workload_apply_failed(
        workload_id=workload.id,
        stream_id="stream-1",
        version=workload.latest_policy_id,
        error="Error: syntax error",
    )
    assert state(workload) == "degraded"
    body = api.get(f"/api/v1/workloads/{workload.id}").json()
    assert body["sync"]["error"] == "Error: syntax error"
    assert api.get("/api/v1/workloads").json()["items"][0]["id"] == str(workload.id)


@pytest.mark.parametrize("start", ["synced", "degraded", "pending"])
def test_new_latest_version_with_an_open_stream_is_pending(api, db, start):
    workload = connect(make_workload())
    if start == "synced":
        sync.workload_applied(
            workload_id=workload.id, stream_id="stream-1", version=workload.latest_policy_id
        )
    if start == "degraded":
        sync.workload_apply_failed(
            workload_id=workload.id, stream_id="stream-1", version=workload.latest_policy_id, error="e"
        )
    bump_latest(workload)
    assert workload.sync_state == "pending"
    body = api.get(f"/api/v1/workloads/{workload.id}").json()
    assert body["sync"]["pending_version"] == body["latest_version"] == workload.latest_policy_id
    assert body["sync"]["error"] is None


def test_new_latest_version_while_offline_stays_offline(db):
    workload = make_workload()
    before = workload.latest_policy_id
    bump_latest(workload)
    assert workload.sync_state == "offline" and workload.latest_policy_id != before


@pytest.mark.parametrize("start", ["pending", "synced", "degraded"])
def test_stream_end_is_offline_and_a_stale_end_is_ignored(db, start):
    workload = connect(make_workload())
    if start == "synced":
        sync.workload_applied(
            workload_id=workload.id, stream_id="stream-1", version=workload.latest_policy_id
        )
    if start == "degraded":
        sync.workload_apply_failed(
            workload_id=workload.id, stream_id="stream-1", version=workload.latest_policy_id, error="e"
        )
    connect(workload, stream_id="stream-2")  # reconnected before the old stream's end was recorded
    sync.workload_stream_ended(workload_id=workload.id, stream_id="stream-1")
    assert state(workload) == "pending"
    sync.workload_stream_ended(workload_id=workload.id, stream_id="stream-2")
    assert state(workload) == "offline"
    assert workload.stream_id == ""


def test_degraded_then_resend_then_apply_is_synced(api, db, django_capture_on_commit_callbacks):
    workload = connect(make_workload())
    sync.workload_apply_failed(
        workload_id=workload.id, stream_id="stream-1", version=workload.latest_policy_id, error="e"
    )
    with django_capture_on_commit_callbacks(execute=True):
        assert api.post(f"/api/v1/workloads/{workload.id}/resend-snapshot").status_code == 200
    # The agent reconnects: the old stream ends, a new one begins with a fresh snapshot.
    sync.workload_stream_ended(workload_id=workload.id, stream_id="stream-1")
    connect(workload, stream_id="stream-2")
    sync.workload_applied(workload_id=workload.id, stream_id="stream-2", version=workload.latest_policy_id)
    assert state(workload) == "synced"


def test_events_of_a_closed_stream_change_nothing(db):
    workload = connect(make_workload())
    sync.workload_stream_ended(workload_id=workload.id, stream_id="stream-1")
    sync.workload_applied(workload_id=workload.id, stream_id="stream-1", version=workload.latest_policy_id)
    assert state(workload) == "offline" and workload.applied_version == ""


def test_resend_is_refused_for_offline_workloads_with_when_last_heard(api, db):
    never = make_workload()
    body = assert_problem(api.post(f"/api/v1/workloads/{never.id}/resend-snapshot"), 409, "workload-offline")
    assert body["last_heard_from"] is None and "never connected" in body["detail"]
    gone = connect(make_workload())
    sync.workload_stream_ended(workload_id=gone.id, stream_id="stream-1")
    gone.refresh_from_db()
    body = assert_problem(api.post(f"/api/v1/workloads/{gone.id}/resend-snapshot"), 409, "workload-offline")
    assert body["last_heard_from"] == clock.rfc3339(gone.last_heard_from)
    assert_problem(
        api.post("/api/v1/workloads/00000000-0000-0000-0000-000000000000/resend-snapshot"), 404, "not-found"
    )


def test_resend_is_refused_while_reconnecting(api, db):
    workload = make_workload()
    Workload.objects.filter(id=workload.id).update(
        last_flow_report_at=clock.now(), last_heard_from=clock.now()
    )
    body = api.get(f"/api/v1/workloads/{workload.id}").json()
    assert body["sync"]["state"] == "offline" and body["health"]["telemetry_live"] is True
    assert_problem(api.post(f"/api/v1/workloads/{workload.id}/resend-snapshot"), 409, "workload-offline")


def test_resend_fires_the_directive_to_the_workloads_group_after_commit(
    api, db, django_capture_on_commit_callbacks
):
    workload = connect(make_workload())
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(stream_group(workload.id), channel)
    with django_capture_on_commit_callbacks(execute=True):
        response = api.post(f"/api/v1/workloads/{workload.id}/resend-snapshot")
    assert response.status_code == 200 and response.json()["directive"] == "sent"
    assert async_to_sync(layer.receive)(channel) == {"type": "resend.snapshot"}


def test_enforcement_removed_ranks_first_matches_removed_and_counts_only_as_removed(api, db):
    a = connect(make_workload(hostname="a"))
    b = connect(make_workload(hostname="b"))
    sync.workload_applied(workload_id=a.id, stream_id="stream-1", version=a.latest_policy_id)
    sync.workload_applied(workload_id=b.id, stream_id="stream-1", version=b.latest_policy_id)
    sync.workload_table_reported(workload_id=b.id, stream_id="stream-1", state="absent")
    body = api.get("/api/v1/workloads").json()
    assert [w["hostname"] for w in body["items"]] == ["b", "a"]
    assert body["items"][0]["health"]["owned_table"]["state"] == "absent"
    assert [w["hostname"] for w in api.get("/api/v1/workloads?removed=true").json()["items"]] == ["b"]
    assert [w["hostname"] for w in api.get("/api/v1/workloads?removed=false").json()["items"]] == ["a"]
    # The stored state still records the last acknowledgement.
    assert [w["hostname"] for w in api.get("/api/v1/workloads?sync_state=synced").json()["items"]] == [
        "b",
        "a",
    ]
    counts = api.get("/api/v1/workloads/counts").json()
    assert counts == {
        "total": 2,
        "sync_state": {"synced": 1, "pending": 0, "degraded": 0, "offline": 0},
        "removed": 1,
    }
    sync.workload_table_reported(workload_id=b.id, stream_id="stream-1", state="present")
    assert api.get("/api/v1/workloads/counts").json()["sync_state"]["synced"] == 2


def test_removed_whatever_the_sync_state(api, db):
    workload = connect(make_workload())
    sync.workload_table_reported(workload_id=workload.id, stream_id="stream-1", state="absent")
    sync.workload_stream_ended(workload_id=workload.id, stream_id="stream-1")
    counts = api.get("/api/v1/workloads/counts").json()
    assert counts["removed"] == 1 and counts["sync_state"]["offline"] == 0
    assert api.get("/api/v1/workloads?sync_state=offline&removed=true").json()["items"][0]["id"] == str(
        workload.id
    )


def test_telemetry_live_is_two_flow_windows(api, db, clock_at, settings):
    workload = make_workload()
    Workload.objects.filter(id=workload.id).update(last_flow_report_at=clock.now())
    assert api.get(f"/api/v1/workloads/{workload.id}").json()["health"]["telemetry_live"] is True
    clock_at(timedelta(seconds=2 * settings.PALISADE_FLOW_WINDOW_SECONDS + 1))
    assert api.get(f"/api/v1/workloads/{workload.id}").json()["health"]["telemetry_live"] is False


def test_telemetry_live_is_two_of_the_windows_the_workload_reports(api, db, clock_at):
    """An agent on 5-second windows has gone quiet after 10 seconds, not after two of the default's."""
    workload = make_workload()
    Workload.objects.filter(id=workload.id).update(last_flow_report_at=clock.now(), flow_window_seconds=5)
    clock_at(timedelta(seconds=9))
    assert api.get(f"/api/v1/workloads/{workload.id}").json()["health"]["telemetry_live"] is True
    clock_at(timedelta(seconds=2))
    assert api.get(f"/api/v1/workloads/{workload.id}").json()["health"]["telemetry_live"] is False


def test_streams_silent_for_long_are_recorded_as_ended(db, clock_at):
    alive = connect(make_workload(hostname="alive"))
    orphan = connect(make_workload(hostname="orphan"))
    clock_at(timedelta(minutes=4))  # past housekeeping.STREAM_SILENT (three minutes)
    sync.workload_heard_from(workload_id=alive.id, stream_id="stream-1")
    assert streams_reap_step() == 1
    assert state(orphan) == "offline" and state(alive) == "pending"


HEARTBEAT_FIELDS = ("last_heard_from", "flow_process_alive_at", "sync_state", "rank", "owned_table_state")


@pytest.mark.parametrize(
    ("reporting", "alive_at", "process", "stream"),
    [
        ("p1", None, "p1", "stream-1"),  # the reporting process: alive from now
        ("p1", -30, "p1", "stream-1"),  # alive later than known
        ("p1", 30, "p1", "stream-1"),  # known alive later already: unchanged
        ("p1", -30, "p2", "stream-1"),  # another process says nothing of the reporting one
        ("p1", -30, "", "stream-1"),
        ("", None, "", "stream-1"),
        ("p1", -30, "p1", "stream-old"),  # not the workload's stream: nothing at all
    ],
)
def test_a_heartbeat_with_nothing_new_records_what_the_locked_heartbeat_records(
    db, monkeypatch, reporting, alive_at, process, stream
):
    """sync.workload_alive, the heartbeats' one statement, against workload_heard_from's locked read
    and save, on two workloads alike."""
    pair = []
    now = clock.now() + timedelta(seconds=75)
    for hostname in ("locked", "alive"):
        workload = connect(make_workload(hostname=hostname))
        sync.workload_table_reported(workload_id=workload.id, stream_id="stream-1", state="present")
        Workload.objects.filter(id=workload.id).update(
            flow_process_start_id=reporting,
            flow_process_alive_at=None if alive_at is None else now + timedelta(seconds=alive_at),
        )
        pair.append(workload)
    monkeypatch.setattr(clock, "now", lambda: now)
    before = [Workload.objects.values(*HEARTBEAT_FIELDS).get(id=w.id) for w in pair]
    sync.workload_heard_from(workload_id=pair[0].id, stream_id=stream, process_start_id=process)
    sync.workload_alive(workload_id=pair[1].id, stream_id=stream, process_start_id=process)
    after = [Workload.objects.values(*HEARTBEAT_FIELDS).get(id=w.id) for w in pair]
    if stream != "stream-1":
        assert after == before
        return
    assert after[1] == after[0]
    assert after[1]["last_heard_from"] == now


OPENED_FIELDS = (
    "stream_id", "sync_state", "sync_error", "last_heard_from", "agent_version", "stream_gateway", "rank",
    "owned_table_state",
)  # fmt: skip


@pytest.mark.parametrize(
    ("recorded", "reported", "statements"),
    [
        ("present", None, 1),  # no report: one statement
        ("present", "unknown", 1),  # not a report either
        ("present", "present", 1),  # the recorded state again: one statement
        ("absent", "absent", 1),
        ("present", "absent", None),  # a change, with its webhook event: the locked path
        ("absent", "present", None),
    ],
)
def test_a_stream_opened_in_one_statement_records_what_the_locked_path_records(
    db, monkeypatch, recorded, reported, statements
):
    """A reconnect that reports its owned table's state as recorded (or none) is one UPDATE; the
    locked read and save it replaced (taken on a change) leave the same row, degraded or offline."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    workload = connect(make_workload(hostname="reconnects"))
    Workload.objects.filter(id=workload.id).update(
        owned_table_state=recorded, sync_state="degraded", sync_error="Error: boom", rank=0
    )
    events = []
    recorded_events = sync.webhook_events_record
    monkeypatch.setattr(
        sync, "webhook_events_record", lambda found: recorded_events(events.extend(found) or found)
    )
    with CaptureQueriesContext(connection) as queries:
        sync.workload_stream_opened(
            workload_id=workload.id, stream_id="stream-2", agent_version="0.2.0\x00", gateway="a:1",
            owned_table_state=reported,
        )  # fmt: skip
    after = Workload.objects.values(*OPENED_FIELDS).get(id=workload.id)
    state = reported if reported in ("present", "absent") else recorded
    assert after["stream_id"] == "stream-2" and after["sync_state"] == "pending" and after["sync_error"] == ""
    assert after["agent_version"] == "0.2.0\\x00" and after["stream_gateway"] == "a:1"
    assert after["owned_table_state"] == state
    assert after["rank"] == (Workload.RANK_ATTENTION if state == "absent" else Workload.RANK_PENDING)
    if statements is not None:
        assert len(queries) == statements and events == []
    else:
        assert len(queries) > 1
        assert [event.type for event in events] == [
            "workload.enforcement_removed" if state == "absent" else "workload.enforcement_restored"
        ]


def test_a_stream_opened_for_a_workload_that_is_gone_is_not_found(db):
    with pytest.raises(Problem):
        sync.workload_stream_opened(workload_id="00000000-0000-0000-0000-000000000001", stream_id="s")

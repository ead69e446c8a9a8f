"""The fleet's figures for Prometheus (controlplane/metrics_collector.py) are the API's: the sync states and
`removed` of GET /workloads/counts, and telemetry live, clock skew and the credential states as each
workload's representation shows them. Each is checked against the API's reads, and its definition
case by case at its boundaries, so a change to either side of a definition fails here."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.conf import settings

from controlplane import clock
from controlplane.metrics_collector import FleetCollector, fleet_figures
from fleet import health, sync
from fleet.credentials import credential_beyond_grace, credential_grace, credential_state
from fleet.models import Workload
from fleet.representations import telemetry_live
from flows.models import UnsummedWindow
from tests.support.workloads import connect, make_workload


def _update(workload: Workload, **fields) -> Workload:
    Workload.objects.filter(id=workload.id).update(**fields)
    workload.refresh_from_db()
    return workload


@pytest.fixture
def fleet(db):
    """Seven workloads, each in other states (the reads compare within seconds of `now`)."""
    now = clock.now()
    synced = connect(make_workload(hostname="synced"))
    sync.workload_applied(workload_id=synced.id, stream_id="stream-1", version=synced.latest_policy_id)
    _update(synced, last_flow_report_at=now - timedelta(seconds=100), flow_window_seconds=60)

    pending = connect(make_workload(hostname="pending", mode="simulation"))
    _update(pending, clock_skew_seconds=300.0, clock_skew_seen_at=now, credential_renewal_failed=True)

    degraded = connect(make_workload(hostname="degraded", mode="enforced"))
    sync.workload_apply_failed(
        workload_id=degraded.id, stream_id="stream-1", version=degraded.latest_policy_id, error="nft"
    )
    removed = connect(make_workload(hostname="removed", mode="enforced"))
    sync.workload_applied(workload_id=removed.id, stream_id="stream-1", version=removed.latest_policy_id)
    sync.workload_table_reported(workload_id=removed.id, stream_id="stream-1", state="absent")

    never = _update(
        make_workload(hostname="never-connected"),
        enrolled_at=now - timedelta(hours=2),
        credential_expires_at=now - timedelta(days=1),
    )
    gone = connect(make_workload(hostname="gone"))
    sync.workload_stream_ended(workload_id=gone.id, stream_id="stream-1")
    _update(
        gone,
        last_heard_from=now - timedelta(minutes=20),
        credential_expires_at=now - credential_grace() - timedelta(seconds=1),
        last_flow_report_at=now - timedelta(seconds=121),
        flow_window_seconds=60,
    )
    # Live within two of its own windows: 30 s ago is live for windows of 20 s, not for windows of 10 s.
    live = _update(
        make_workload(hostname="twenty-second-windows"),
        last_flow_report_at=now - timedelta(seconds=30),
        flow_window_seconds=20,
        flow_backlog_since=now - timedelta(seconds=30),
    )
    _update(pending, last_flow_report_at=now - timedelta(seconds=30), flow_window_seconds=10)
    return {w.hostname: w for w in (synced, pending, degraded, removed, never, gone, live)}


def test_each_figure_is_what_the_api_reads_show(api, fleet):
    figures = fleet_figures(now=clock.now())
    counts = api.get("/api/v1/workloads/counts").json()
    assert figures["total"] == counts["total"] == 7
    assert figures["sync_state"] == counts["sync_state"] == {
        "synced": 1, "pending": 1, "degraded": 1, "offline": 3,
    }  # fmt: skip
    assert figures["removed"] == counts["removed"] == 1

    items = api.get("/api/v1/workloads?limit=100").json()["items"]
    health = [item["health"] for item in items]
    assert figures["telemetry_live"] == sum(h["telemetry_live"] for h in health) == 2
    assert figures["clock_skew"] == sum(h["clock_skew"] is not None for h in health) == 1
    assert figures["credential_state"] == {
        state: sum(h["credential"]["state"] == state for h in health)
        for state in ("renews", "renewal-failed", "expired")
    } == {"renews": 4, "renewal-failed": 1, "expired": 2}  # fmt: skip
    assert figures["credential_beyond_grace"] == 1
    assert figures["mode"] == {
        mode: sum(item["mode"] == mode for item in items) for mode in ("visibility", "simulation", "enforced")
    } == {"visibility": 4, "simulation": 1, "enforced": 2}  # fmt: skip
    # Offline: the one never connected (enrolled 2 h ago), the one gone 20 min ago, the one that never
    # connected just now; the removed one counts as removed, not offline.
    assert figures["offline_for_more_than"] == {60: 2, 600: 2, 3600: 1, 86400: 0}
    assert figures["flow_backlog_oldest_age"] == pytest.approx(30, abs=5)


def test_the_collector_yields_them_as_prometheus_families(fleet):
    families = {family.name: family for family in FleetCollector().collect()}
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families.values()
        for sample in family.samples
    }
    assert samples[("palisade_workloads", ())] == 7
    assert samples[("palisade_workloads_by_sync_state", (("sync_state", "offline"),))] == 3
    assert samples[("palisade_workloads_enforcement_removed", ())] == 1
    assert samples[("palisade_workloads_offline_for_more_than", (("seconds", "600"),))] == 2
    assert samples[("palisade_fleet_read_success", ())] == 1
    assert {family.name for family in FleetCollector().describe()} == set(families)


def test_a_failed_read_is_a_scrape_that_says_so(db, monkeypatch):
    from django.db import OperationalError

    from controlplane import metrics_collector

    def failing(now):
        raise OperationalError("canceling statement due to statement timeout")

    monkeypatch.setattr(metrics_collector, "fleet_figures", failing)
    samples = {family.name: family.samples for family in FleetCollector().collect()}
    assert set(samples) == {"palisade_fleet_read_success", "palisade_fleet_read_seconds"}
    assert samples["palisade_fleet_read_success"][0].value == 0


@pytest.mark.postgres
def test_the_scrapes_reads_run_under_a_statement_timeout(db, monkeypatch):
    from django.db import connection

    from controlplane import metrics_collector

    seen = []

    def figures(now):
        with connection.cursor() as cursor:
            cursor.execute("SHOW statement_timeout")
            seen.append(cursor.fetchone()[0])
        return {}

    monkeypatch.setattr(metrics_collector, "fleet_figures", figures)
    metrics_collector._bounded_read(clock.now())
    assert seen == ["2s"]


def test_telemetry_live_is_one_definition_at_its_boundary(db):
    now = clock.now()
    default = settings.PALISADE_FLOW_WINDOW_SECONDS
    for seconds in (0, 1, 60):
        limit = health.limit(timedelta(seconds=seconds or default))
        for age in (
            timedelta(0),
            limit - timedelta(milliseconds=1),
            limit,
            limit + timedelta(milliseconds=1),
        ):
            workload = make_workload(render=False)
            _update(workload, last_flow_report_at=now - age, flow_window_seconds=seconds)
    make_workload(render=False)  # never reported
    live = sum(telemetry_live(w, now) for w in Workload.objects.all())
    assert live == 9  # three ages of four are within two windows, for each of three window lengths
    assert fleet_figures(now=now)["telemetry_live"] == live


def test_the_credential_states_are_one_definition_at_their_boundaries(db):
    now = clock.now()
    grace = credential_grace()
    for expires in (now - grace - timedelta(seconds=1), now - grace, now - timedelta(seconds=1), now,
                    now + timedelta(seconds=1)):  # fmt: skip
        for failed in (False, True):
            _update(
                make_workload(render=False), credential_expires_at=expires, credential_renewal_failed=failed
            )
    workloads = list(Workload.objects.all())
    figures = fleet_figures(now=now)
    assert figures["credential_state"] == {
        state: sum(credential_state(w, now) == state for w in workloads)
        for state in ("renews", "renewal-failed", "expired")
    } == {"renews": 1, "renewal-failed": 1, "expired": 8}  # fmt: skip
    assert figures["credential_beyond_grace"] == sum(credential_beyond_grace(w, now) for w in workloads) == 4


def test_the_oldest_unsummed_windows_age(db):
    workload = make_workload(render=False)
    now = clock.now()
    assert fleet_figures(now=now)["oldest_unsummed_window_age"] == 0
    for minutes in (3, 25):
        UnsummedWindow.objects.create(
            window_id=uuid.uuid4(), workload=workload, start=now - timedelta(minutes=minutes)
        )
    assert fleet_figures(now=now)["oldest_unsummed_window_age"] == 25 * 60

"""GET /metrics and this process's own instruments (controlplane/metrics.py): who may read it, what
prometheus_client writes, and the counters that move only when what they count is committed."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from django.db import transaction

from controlplane import clock, metrics, runtime
from fleet.sync import workload_applied, workload_stream_opened
from flows.reports import REFUSAL_CODES
from flows.services import flow_report_ingest
from tests.support.flow_evidence import at_agent_clock, enrolled, flow_report, golden, windows_between
from tests.support.helpers import assert_problem
from tests.support.prometheus import check_metrics
from tests.support.workloads import connect, make_workload


def value(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


class Delta:
    """How far each named sample moved since this was made."""

    def __init__(self, *samples: tuple[str, dict]):
        self.samples = samples
        self.before = [value(name, **labels) for name, labels in samples]

    def __call__(self) -> list[float]:
        return [
            value(name, **labels) - before
            for (name, labels), before in zip(self.samples, self.before, strict=True)
        ]


def test_metrics_needs_an_operator_credential(anon, api, db):
    assert_problem(anon.get("/metrics"), 401, "unauthenticated")
    anon.credentials(HTTP_AUTHORIZATION="Bearer pal_op_not-a-token")
    assert_problem(anon.get("/metrics"), 401, "unauthenticated")
    answer = api.get("/metrics")
    assert answer.status_code == 200
    assert answer["Content-Type"].startswith("text/plain; version=0.0.4")


def test_the_exposition_is_prometheus_clients_and_promtool_finds_nothing_to_say(api, db):
    connect(make_workload())
    text = api.get("/metrics").content.decode()
    assert 'palisade_workloads_by_sync_state{sync_state="pending"} 1.0' in text
    assert "palisade_flow_reports_refused_total" in text and "process_resident_memory_bytes" in text
    assert "_created" not in text  # one series per counter, not two
    check_metrics(text)
    openmetrics = api.get("/metrics", HTTP_ACCEPT="application/openmetrics-text;version=1.0.0,*/*;q=0.1")
    assert openmetrics["Content-Type"].startswith("application/openmetrics-text")
    assert openmetrics.content.decode().endswith("# EOF\n")


def test_the_metrics_are_not_in_the_openapi_document():
    paths = yaml.safe_load((Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml").read_text())[
        "paths"
    ]
    assert paths and not [path for path in paths if "metrics" in path]


@pytest.fixture
def committed(django_capture_on_commit_callbacks, monkeypatch):
    """Runs what waits for the commit when the block ends, as a commit would (the test's transaction
    is still rolled back after: the partitions it made are not remembered as made)."""
    from flows import partitions

    monkeypatch.setattr(partitions, "_known", set(partitions._known))
    return lambda: django_capture_on_commit_callbacks(execute=True)


GOOD = ("palisade_flow_reports_ingested_total", {})
WINDOWS = ("palisade_flow_windows_ingested_total", {})
RESENT = ("palisade_flow_windows_resent_total", {})
GROUPS = ("palisade_flow_group_rows_ingested_total", {})
MALFORMED = ("palisade_flow_windows_refused_total", {"reason": "malformed"})
MALFORMED_GROUPS = ("palisade_flow_group_rows_refused_total", {"reason": "malformed"})
OVERRUN = ("palisade_evidence_gaps_recorded_total", {"kind": "source_overrun", "source": "conntrack"})
SILENT = ("palisade_evidence_gaps_recorded_total", {"kind": "agent_silent", "source": "none"})


def _report():
    data = at_agent_clock(golden(), clock.now())
    window = data["windows"][0]
    malformed = {**window, "id": str(uuid.uuid4()), "accounting": "yes"}
    return {**data, "windows": [window, malformed]}


def test_flow_counters_move_when_the_ingest_commits(db, committed):
    workload, _, _ = enrolled()
    delta = Delta(GOOD, WINDOWS, RESENT, GROUPS, MALFORMED, MALFORMED_GROUPS, OVERRUN)
    with committed():
        flow_report_ingest(workload_id=str(workload.id), data=_report())
    assert delta() == [1, 1, 0, 2, 1, 2, 1]
    with committed():
        flow_report_ingest(workload_id=str(workload.id), data=_report())  # the same window again
    assert delta() == [2, 1, 1, 2, 2, 4, 1]


def test_a_rolled_back_ingest_counts_nothing(db, committed):
    workload, _, _ = enrolled()
    delta = Delta(GOOD, WINDOWS, GROUPS, MALFORMED, OVERRUN)
    with committed(), pytest.raises(RuntimeError):
        with transaction.atomic():
            flow_report_ingest(workload_id=str(workload.id), data=_report())
            raise RuntimeError("rolled back")
    assert delta() == [0, 0, 0, 0, 0]


def test_agent_silent_is_counted_as_the_control_plane_records_it(db, clock_at, committed):
    workload, _, _ = enrolled()
    delta = Delta(SILENT)
    report = {**golden(), "windows": [], "gaps": []}
    with committed():
        flow_report_ingest(workload_id=str(workload.id), data=at_agent_clock(report, clock.now()))
        clock_at(timedelta(minutes=10))
        restarted = {**report, "process_start_id": "another", "uptime_seconds": 5.0}
        flow_report_ingest(workload_id=str(workload.id), data=at_agent_clock(restarted, clock.now()))
    assert delta() == [1]


def _refused(name: str, reason: str) -> tuple[str, dict]:
    return (f"palisade_flow_{name}_refused_total", {"reason": reason})


def test_refused_items_are_counted_by_the_code_they_carry(db, committed):
    """Each refusal is counted by its code (flows/reports.py REFUSAL_CODES), whatever its message
    says: a malformed window, one outside the stored range, one whose id another workload holds, and
    a malformed gap."""
    first, _, _ = enrolled()
    second = make_workload(hostname="second", render=False)
    runtime.facts_set(flow_retention_days=30)
    fine = windows_between(clock.now() - timedelta(minutes=10), 1)
    old = windows_between(clock.now() - timedelta(days=31), 1)
    malformed = {**windows_between(clock.now() - timedelta(minutes=20), 1)[0], "accounting": "yes"}
    delta = Delta(
        *(_refused("windows", code) for code in metrics.ITEM_REFUSALS),
        *(_refused("group_rows", code) for code in metrics.ITEM_REFUSALS),
        *(_refused("gaps", code) for code in metrics.ITEM_REFUSALS),
    )
    with committed():
        flow_report_ingest(workload_id=str(first.id), data=flow_report("p1", 100, fine))
        report = flow_report("p2", 100, [*old, malformed, *fine])
        report["gaps"] = [{**golden()["gaps"][0], "id": str(uuid.uuid4()), "kind": "no-such-kind"}]
        answer = flow_report_ingest(workload_id=str(second.id), data=report)
    assert [item["result"] for item in answer["windows"]] == ["refused"] * 3
    # malformed, outside_stored_range, id_taken: windows, then their group rows, then gaps
    assert delta() == [1, 1, 1, 1, 1, 1, 1, 0, 0]


def test_the_metrics_count_every_refusal_code_from_zero():
    assert metrics.ITEM_REFUSALS == REFUSAL_CODES
    for counter in (metrics.FLOW_WINDOWS_REFUSED, metrics.FLOW_GROUP_ROWS_REFUSED, metrics.FLOW_GAPS_REFUSED):
        (family,) = counter.collect()
        assert {sample.labels["reason"] for sample in family.samples} == set(REFUSAL_CODES)


ACK = ("palisade_policy_acknowledgement_seconds_count", {})


def test_the_first_acknowledgement_of_a_new_latest_version_is_timed_once(db, clock_at, committed):
    workload = connect(make_workload())
    version = workload.latest_policy_id
    delta = Delta(ACK)
    clock_at(timedelta(seconds=42))
    sum_before = value("palisade_policy_acknowledgement_seconds_sum")
    with committed():
        workload_applied(workload_id=workload.id, stream_id="stream-1", version=version)
    assert delta() == [1]
    assert value("palisade_policy_acknowledgement_seconds_sum") - sum_before == pytest.approx(42, abs=5)
    # The same version again (a repeated ack, a reconnect that re-applies it) is no new version.
    with committed():
        workload_applied(workload_id=workload.id, stream_id="stream-1", version=version)
        workload_stream_opened(workload_id=workload.id, stream_id="stream-2")
        workload_applied(workload_id=workload.id, stream_id="stream-2", version=version)
        # Nor is a version that is not the latest.
        workload_applied(workload_id=workload.id, stream_id="stream-2", version="sha256:old")
    assert delta() == [1]


def test_http_answers_are_counted_by_listener_and_status_class():
    delta = Delta(
        ("palisade_http_responses_total", {"listener": "gateway", "status_class": "4xx"}),
        ("palisade_http_responses_total", {"listener": "operator", "status_class": "2xx"}),
    )
    metrics.http_answered("gateway", 413)
    metrics.http_answered("operator", 204)
    assert delta() == [1, 1]

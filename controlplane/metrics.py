"""This process's own Prometheus instruments (docs/metrics.md), in a registry of our own.

The figures of the fleet are not here: they are read from the database when Prometheus scrapes
(controlplane/metrics_collector.py), so that every serve process of a site shows the same ones. What is here
counts what this process did, and no label grows with the fleet: no workload, no path, only values
from fixed lists (listeners, status classes, problem names, gap kinds, housekeeping steps).

Counters of what a write stored move when its transaction commits (`transaction.on_commit`): a
rolled-back ingest counts nothing. The exposition is prometheus_client's (controlplane/api/metrics.py).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from django.db import transaction
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from agent.collector_time import GENERATIONS, collector_time
from agent.protocol import FLOWS_PATH
from controlplane import clock

# A `_created` sample beside every counter and histogram doubles the series for no alert's use.
disable_created_metrics()

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)

LISTENERS = ("operator", "gateway")
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
# The codes of a window, a gap or a window's group rows refused one by one, the rest of the report
# landing: flows/reports.py REFUSAL_CODES (a test keeps this copy equal; the series show from zero).
ITEM_REFUSALS = ("malformed", "outside_stored_range", "id_taken")
# Whole reports are refused with a problem document; its type is the reason. These are the ones a
# report meets (controlplane/body_gate.py, flows/gateway.py, fleet/report_auth.py): shown from zero.
REPORT_REFUSALS = (
    "unauthenticated",
    "credential-revoked",
    "payload-too-large",
    "malformed-request",
    "validation",
    "not-found",
    "rate-limited",
    "service-unavailable",
    "internal",
)
GAP_KINDS = (
    "source_overrun",
    "source_restart",
    "buffer_overflow",
    "dump_truncated",
    "window_overflow",
    "window_rejected",
    "table_removed",
    "table_modified",
    "agent_silent",
    "keys_aggregated",
)
GAP_SOURCES = ("conntrack", "nflog", "none")

HTTP_RESPONSES = Counter(
    "palisade_http_responses",
    "HTTP answers this process sent, by listener and status class.",
    ["listener", "status_class"],
    registry=REGISTRY,
)
FLOW_REPORTS_INGESTED = Counter(
    "palisade_flow_reports_ingested",
    "Flow reports whose windows and gaps this process stored (their transaction committed).",
    registry=REGISTRY,
)
FLOW_REPORTS_REFUSED = Counter(
    "palisade_flow_reports_refused",
    "Flow reports refused whole, by the type of the problem answered.",
    ["reason"],
    registry=REGISTRY,
)
FLOW_WINDOWS_INGESTED = Counter(
    "palisade_flow_windows_ingested",
    "Flow windows stored (a re-sent window is counted once, here, and then as resent).",
    registry=REGISTRY,
)
FLOW_WINDOWS_RESENT = Counter(
    "palisade_flow_windows_resent",
    "Flow windows sent again after a lost acknowledgement: acknowledged, already stored.",
    registry=REGISTRY,
)
FLOW_WINDOWS_REFUSED = Counter(
    "palisade_flow_windows_refused",
    "Flow windows refused one by one in a report that landed.",
    ["reason"],
    registry=REGISTRY,
)
FLOW_GROUP_ROWS_INGESTED = Counter(
    "palisade_flow_group_rows_ingested",
    "Group rows (peer, service, decision, rule) of the flow windows stored.",
    registry=REGISTRY,
)
FLOW_GROUP_ROWS_REFUSED = Counter(
    "palisade_flow_group_rows_refused",
    "Group rows of the flow windows refused, by the window's reason.",
    ["reason"],
    registry=REGISTRY,
)
FLOW_GAPS_REFUSED = Counter(
    "palisade_flow_gaps_refused",
    "Evidence gaps an agent reported that were refused one by one.",
    ["reason"],
    registry=REGISTRY,
)
OWNED_TABLE_MODIFICATIONS = Counter(
    "palisade_owned_table_modifications",
    "Hand edits of agents' owned tables that agents reported, by whether the agent put its table back.",
    ["outcome"],
    registry=REGISTRY,
)
for _outcome in ("restored", "not_restored"):
    OWNED_TABLE_MODIFICATIONS.labels(_outcome)
EVIDENCE_GAPS_RECORDED = Counter(
    "palisade_evidence_gaps_recorded",
    "Evidence gaps stored: reported by agents, or agent_silent derived by the control plane.",
    ["kind", "source"],
    registry=REGISTRY,
)
RENDER_DOCUMENT_SECONDS = Histogram(
    "palisade_render_document_seconds",
    "Time to render one workload's document.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    registry=REGISTRY,
)
RENDER_FANOUT_SECONDS = Histogram(
    "palisade_render_fanout_seconds",
    "Time to re-render the workloads one change affects, store the documents and move their versions.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    registry=REGISTRY,
)
ACKNOWLEDGEMENT_SECONDS = Histogram(
    "palisade_policy_acknowledgement_seconds",
    "Time from a workload's new latest version to its agent's first acknowledgement of it "
    "(offline time included).",
    buckets=(0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0, 86400.0),
    registry=REGISTRY,
)
STREAMS_HELD = Gauge(
    "palisade_streams_held",
    "Agent sync streams this process holds.",
    registry=REGISTRY,
)
STREAM_ADMISSIONS_REFUSED = Counter(
    "palisade_stream_admissions_refused",
    "Agents' sync streams closed at once with 4503 and a retry-after, this process having as many "
    "authentications in progress as it admits (PALISADE_STREAM_AUTHENTICATIONS).",
    registry=REGISTRY,
)
HANDSHAKES_CLOSED = Counter(
    "palisade_handshakes_closed",
    "Stalled unfinished handshakes (connections before their first request head) closed at the "
    "listener's bound (--max-handshakes): to admit a new connection, or by the sweep while the listener "
    "is not accepting.",
    ["listener"],
    registry=REGISTRY,
)
HANDSHAKES_REFUSED = Counter(
    "palisade_handshakes_refused",
    "New connections refused as they were accepted at the listener's bound on unfinished handshakes "
    "(--max-handshakes), none of those being stalled.",
    ["listener"],
    registry=REGISTRY,
)
STREAM_AUTHENTICATIONS_IN_PROGRESS = Gauge(
    "palisade_stream_authentications_in_progress",
    "Agents' sync streams this process has admitted and not yet authenticated or closed.",
    registry=REGISTRY,
)
HEAVY_REQUESTS = Gauge(
    "palisade_heavy_requests",
    "Heavy requests this process has given to its worker processes: running in one, or waiting for one.",
    registry=REGISTRY,
)
HOUSEKEEPING_LAST_SUCCESS = Gauge(
    "palisade_housekeeping_last_success_timestamp_seconds",
    "When each housekeeping step last finished without failing (Unix time; 0: not yet).",
    ["step"],
    registry=REGISTRY,
)
HOUSEKEEPING_FAILURES = Counter(
    "palisade_housekeeping_failures",
    "Rounds of each housekeeping step that failed.",
    ["step"],
    registry=REGISTRY,
)


class _CollectorTimeMetric(Collector):
    """The cyclic collector's time in this process (agent/collector_time.py), read at the scrape."""

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(
            "palisade_gc_seconds",
            "Seconds this process spent in Python's cyclic garbage collector, by generation "
            "(a pause of everything it does).",
            labels=["generation"],
        )
        for generation in GENERATIONS:
            family.add_metric([str(generation)], collector_time.seconds[generation])
        yield family


COLLECTOR_TIME = _CollectorTimeMetric()
REGISTRY.register(COLLECTOR_TIME)

for _listener in LISTENERS:
    for _status_class in STATUS_CLASSES[1:]:
        HTTP_RESPONSES.labels(_listener, _status_class)
for _reason in REPORT_REFUSALS:
    FLOW_REPORTS_REFUSED.labels(_reason)
for _reason in ITEM_REFUSALS:
    FLOW_WINDOWS_REFUSED.labels(_reason)
    FLOW_GROUP_ROWS_REFUSED.labels(_reason)
    FLOW_GAPS_REFUSED.labels(_reason)
for _kind in GAP_KINDS:
    for _source in GAP_SOURCES if _kind != "agent_silent" else ("none",):
        EVIDENCE_GAPS_RECORDED.labels(_kind, _source)


def status_class(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status < 600 else "5xx"


def http_answered(listener: str, status: int) -> None:
    """An HTTP answer sent on `listener` (whoever wrote it: Django, the body gate, the head limits)."""
    HTTP_RESPONSES.labels(listener if listener in LISTENERS else "operator", status_class(status)).inc()


def answered_unread(listener: str, problem, *, path: str | None) -> None:
    """A problem answered on the HTTP channel, before the request reached the application (a body
    refused unread, a head over Twisted's limits): `problem` is a controlplane.problems.Problem."""
    http_answered(listener, problem.status)
    if path == FLOWS_PATH:
        flow_report_refused(problem.name)


def flow_report_answered(response) -> None:
    """The flow report view's answer: a problem document is a report refused whole, by its type."""
    if response.status_code >= 400:
        flow_report_refused(getattr(response, "problem_name", None) or "internal")


def flow_report_refused(reason: str) -> None:
    """A whole flow report refused; `reason` is the problem's type (a fixed list, controlplane/problems.py)."""
    FLOW_REPORTS_REFUSED.labels(reason).inc()


@dataclass
class FlowItemsCounted:
    """What one ingest transaction stored and refused (flows/services.py), refusals by their code."""

    reports: int = 0
    windows: int = 0
    resent: int = 0
    groups: int = 0
    windows_refused: Tally = field(default_factory=Tally)
    groups_refused: Tally = field(default_factory=Tally)
    gaps_refused: Tally = field(default_factory=Tally)

    def window_refused(self, code: str, raw) -> None:
        """A window refused with `code`, and its group rows with it."""
        groups = raw.get("groups") if isinstance(raw, dict) else None
        self.windows_refused[code] += 1
        self.groups_refused[code] += len(groups) if isinstance(groups, list) else 0


def flow_reports_stored(counted: FlowItemsCounted, *, gaps: list) -> None:
    """What one ingest transaction stored, counted once it commits: `gaps` are the EvidenceGap rows."""
    gap_labels = [(gap.kind, gap.source or "none") for gap in gaps]

    def count() -> None:
        FLOW_REPORTS_INGESTED.inc(counted.reports)
        FLOW_WINDOWS_INGESTED.inc(counted.windows)
        FLOW_WINDOWS_RESENT.inc(counted.resent)
        FLOW_GROUP_ROWS_INGESTED.inc(counted.groups)
        for code, n in counted.windows_refused.items():
            FLOW_WINDOWS_REFUSED.labels(code).inc(n)
        for code, n in counted.groups_refused.items():
            FLOW_GROUP_ROWS_REFUSED.labels(code).inc(n)
        for code, n in counted.gaps_refused.items():
            FLOW_GAPS_REFUSED.labels(code).inc(n)
        for kind, source in gap_labels:
            EVIDENCE_GAPS_RECORDED.labels(kind, source).inc()

    transaction.on_commit(count)


def stream_admission_refused() -> None:
    STREAM_ADMISSIONS_REFUSED.inc()


def stream_authentications_follow(in_progress) -> None:
    """The gauge reads the admission's own count when scraped (fleet/admission.py): one count, kept once."""
    STREAM_AUTHENTICATIONS_IN_PROGRESS.set_function(in_progress)


def owned_table_modified(*, restored: bool) -> None:
    """An agent reported a hand edit of its owned table (counted when the report is stored)."""
    outcome = "restored" if restored else "not_restored"
    transaction.on_commit(lambda: OWNED_TABLE_MODIFICATIONS.labels(outcome).inc())


def policy_applied(*, version: str, before: tuple) -> None:
    """An agent acknowledged `version` (fleet/sync.py); `before` is its workload's (applied version,
    latest version, when the latest moved) as they were. Its first acknowledgement of a new latest
    version is observed; a repeat (a reconnect, the same snapshot again) is not."""
    applied, latest, moved_at = before
    if applied == version or latest != version or moved_at is None:
        return
    if isinstance(moved_at, str):  # SQLite without its column's converter
        moved_at = datetime.fromisoformat(moved_at)
    if moved_at.tzinfo is None:
        moved_at = moved_at.replace(tzinfo=UTC)
    seconds = (clock.now() - moved_at).total_seconds()
    transaction.on_commit(lambda: ACKNOWLEDGEMENT_SECONDS.observe(max(seconds, 0.0)))


def step_name(step) -> str:
    """A housekeeping step's label: its function's name (`flow_windows_sum_step` -> `flow_windows_sum`)."""
    function = step.run or step.run_async
    return function.__name__.removesuffix("_step")


def housekeeping_steps(steps: Iterable) -> None:
    """Show every step from the start: failures at 0, no success yet."""
    for step in steps:
        HOUSEKEEPING_FAILURES.labels(step_name(step))
        HOUSEKEEPING_LAST_SUCCESS.labels(step_name(step))


def housekeeping_succeeded(step) -> None:
    HOUSEKEEPING_LAST_SUCCESS.labels(step_name(step)).set(time.time())


def housekeeping_failed(step) -> None:
    HOUSEKEEPING_FAILURES.labels(step_name(step)).inc()

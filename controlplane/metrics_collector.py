"""The fleet's figures for Prometheus, read from the database when it scrapes (docs/metrics.md).

Read at scrape time rather than counted in memory, so that every serve process of a site shows the same
figures, whichever one Prometheus asks. Each figure is one definition, shared with the API: the sync
states and `removed` are `GET /workloads/counts`' own read (fleet/selectors.py `workload_counts`);
telemetry live, clock skew and the credential states are the filters that stand beside the workload
representation's rules (fleet/selectors.py, fleet/credentials.py, fleet/health.py), and
tests/controlplane/test_metrics_collector.py keeps each equal to what a workload read shows.

A scrape costs a few aggregate statements over the workloads table (no row per workload leaves the
database) and one index probe of the unsummed windows, under a statement timeout: a database that is
slow to answer makes the scrape say so (`palisade_fleet_read_success` 0), not hang.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import datetime

from django.db import DatabaseError, connection, transaction
from django.db.models import Count, Min, Q
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from controlplane import clock
from controlplane.outage import database_failed
from fleet.choices import Mode, SyncState
from fleet.credentials import (
    EXPIRED,
    RENEWAL_FAILED,
    RENEWS,
    credential_beyond_grace_filter,
    credential_state_filters,
)
from fleet.models import Workload
from fleet.selectors import CLOCK_SKEWED, offline_for_more_than_filter, telemetry_live_filter, workload_counts
from flows.models import UnsummedWindow

log = logging.getLogger("palisade.metrics")

STATEMENT_TIMEOUT_MS = 2000
CREDENTIAL_STATES = (RENEWS, RENEWAL_FAILED, EXPIRED)
OFFLINE_THRESHOLDS = (60, 600, 3600, 86400)  # seconds: the bounded values of the `seconds` label


def fleet_figures(*, now: datetime) -> dict:
    """Every fleet figure, as plain numbers (the collector's and the tests' one read)."""
    counts = workload_counts()
    conditional = {f"mode:{mode}": Count("pk", filter=Q(mode=mode)) for mode in Mode.values}
    for state, where in credential_state_filters(now).items():
        conditional[f"credential:{state}"] = Count("pk", filter=where)
    for seconds in OFFLINE_THRESHOLDS:
        conditional[f"offline:{seconds}"] = Count(
            "pk", filter=offline_for_more_than_filter(seconds=seconds, now=now)
        )
    aggregated = Workload.objects.order_by().aggregate(
        **conditional,
        beyond_grace=Count("pk", filter=credential_beyond_grace_filter(now)),
        telemetry_live=Count("pk", filter=telemetry_live_filter(now=now)),
        clock_skew=Count("pk", filter=CLOCK_SKEWED),
        backlog_since=Min("flow_backlog_since"),
    )
    oldest_unsummed = UnsummedWindow.objects.order_by().aggregate(start=Min("start"))["start"]
    return {
        "total": counts["total"],
        "sync_state": counts["sync_state"],
        "removed": counts["removed"],
        "mode": {mode: aggregated[f"mode:{mode}"] for mode in Mode.values},
        "credential_state": {state: aggregated[f"credential:{state}"] for state in CREDENTIAL_STATES},
        "credential_beyond_grace": aggregated["beyond_grace"],
        "telemetry_live": aggregated["telemetry_live"],
        "clock_skew": aggregated["clock_skew"],
        "offline_for_more_than": {
            seconds: aggregated[f"offline:{seconds}"] for seconds in OFFLINE_THRESHOLDS
        },
        "oldest_unsummed_window_age": _age(oldest_unsummed, now),
        "flow_backlog_oldest_age": _age(aggregated["backlog_since"], now),
    }


def _age(instant: datetime | None, now: datetime) -> float:
    return max((now - instant).total_seconds(), 0.0) if instant is not None else 0.0


def _bounded_read(now: datetime) -> dict:
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL statement_timeout = {int(STATEMENT_TIMEOUT_MS)}")
        return fleet_figures(now=now)


def _gauge(name: str, documentation: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=list(labels) if labels else None)


class FleetCollector(Collector):
    """prometheus_client calls `collect` on every scrape of /metrics."""

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Names only: registering the collector must not read the database.
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        started = time.monotonic()
        families = self._families()
        success = families.pop()
        duration = families.pop()
        try:
            figures = _bounded_read(clock.now())
        except DatabaseError as error:
            if not database_failed("read the fleet's metrics", error, log):
                log.warning("cannot read the fleet's metrics: %s", str(error).splitlines()[0:1])
            success.add_metric([], 0)
            duration.add_metric([], time.monotonic() - started)
            yield success
            yield duration
            return
        total, by_sync, removed, by_mode, by_credential, *rest = families
        beyond_grace, live, skew, offline, unsummed, backlog = rest
        total.add_metric([], figures["total"])
        for state in SyncState.values:
            by_sync.add_metric([state], figures["sync_state"][state])
        removed.add_metric([], figures["removed"])
        for mode in Mode.values:
            by_mode.add_metric([mode], figures["mode"][mode])
        for state in CREDENTIAL_STATES:
            by_credential.add_metric([state], figures["credential_state"][state])
        beyond_grace.add_metric([], figures["credential_beyond_grace"])
        live.add_metric([], figures["telemetry_live"])
        skew.add_metric([], figures["clock_skew"])
        for seconds in OFFLINE_THRESHOLDS:
            offline.add_metric([str(seconds)], figures["offline_for_more_than"][seconds])
        unsummed.add_metric([], figures["oldest_unsummed_window_age"])
        backlog.add_metric([], figures["flow_backlog_oldest_age"])
        success.add_metric([], 1)
        duration.add_metric([], time.monotonic() - started)
        yield from families
        yield success
        yield duration

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            _gauge("palisade_workloads", "Workloads enrolled."),
            _gauge(
                "palisade_workloads_by_sync_state",
                "Workloads in each sync state, as GET /workloads/counts (enforcement removed in none).",
                ("sync_state",),
            ),
            _gauge("palisade_workloads_enforcement_removed", "Workloads whose agent reports its table gone."),
            _gauge("palisade_workloads_by_mode", "Workloads in each mode.", ("mode",)),
            _gauge(
                "palisade_workloads_by_credential_state",
                "Workloads in each credential state.",
                ("credential_state",),
            ),
            _gauge(
                "palisade_workloads_credential_beyond_grace",
                "Workloads whose credential expired beyond its renewal grace: only a re-enrolment helps.",
            ),
            _gauge(
                "palisade_workloads_telemetry_live",
                "Workloads whose flow report arrived within two flow windows.",
            ),
            _gauge(
                "palisade_workloads_clock_skew",
                "Workloads whose agent's clock is off by over two flow windows.",
            ),
            _gauge(
                "palisade_workloads_offline_for_more_than",
                "Workloads counted offline and not heard from for more than `seconds`.",
                ("seconds",),
            ),
            _gauge(
                "palisade_flow_oldest_unsummed_window_age_seconds",
                "Age of the oldest stored flow window not yet added to the sums (0: none).",
            ),
            _gauge(
                "palisade_flow_backlog_oldest_age_seconds",
                "Age of the oldest flow evidence a connected agent holds undelivered (0: none).",
            ),
            _gauge("palisade_fleet_read_seconds", "Time this scrape took to read the fleet's figures."),
            _gauge(
                "palisade_fleet_read_success",
                "1 when this scrape read the fleet's figures, 0 when it could not.",
            ),
        ]

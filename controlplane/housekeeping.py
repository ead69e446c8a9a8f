"""serve's periodic work, as plain step functions that tests call directly.

Each step does one round and returns how much it did; serve runs each on its period (`STEPS`), the
database steps on a reactor thread and the stream sweep on the event loop that holds the streams. A
step that fails (the database away, a lost race) is one warning line; the next period tries again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

log = logging.getLogger("palisade.serve")

# Heartbeats refresh a stream's last_heard_from at least every minute; a stream silent for three
# is one whose serve process died.
STREAM_SILENT = timedelta(seconds=180)
# Rendered documents no workload names are removed once they are an hour old (fleet.retention).
UNREFERENCED_DOCUMENT_GRACE = timedelta(seconds=3600)


def streams_reap_step() -> int:
    """Streams left open by a serve process that died without recording them."""
    from fleet.sync import workload_streams_reap

    ended = workload_streams_reap(silent_for=STREAM_SILENT)
    if ended:
        log.info("recorded %d silent agent streams as ended", ended)
    return ended


def documents_prune_step() -> int:
    """Rendered documents no workload names any more."""
    from fleet.retention import rendered_policies_prune

    removed = rendered_policies_prune(older_than=UNREFERENCED_DOCUMENT_GRACE)
    if removed:
        log.info("pruned %d rendered documents no workload names", removed)
    return removed


def flows_prune_step() -> int:
    """Stored flow evidence past its retention (`--flow-retention-days`, default 30)."""
    from flows.retention import flow_retention
    from flows.services import flow_evidence_prune

    pruned = flow_evidence_prune(older_than=flow_retention())
    if pruned.rows or pruned.partitions:
        log.info(
            "flow evidence past its retention: dropped %d day partitions, deleted %d windows and gaps",
            pruned.partitions,
            pruned.rows,
        )
    return pruned.rows + pruned.partitions


def flow_windows_sum_step() -> int:
    """The hourly and ten-minute sums rollups read, for every ten-minute block over a few minutes ago
    (flows.services)."""
    from controlplane import clock
    from flows.sums.ladder import sums_due
    from flows.sums.writes import flow_windows_sum

    summed = flow_windows_sum(before=sums_due(now=clock.now()))
    if summed:
        log.info("added %d flow windows to their hourly and ten-minute sums", summed)
    return summed


def flow_partitions_step() -> int:
    """Day partitions for flow evidence, yesterday to three days ahead (PostgreSQL; nothing on SQLite)."""
    from controlplane import clock
    from flows.partitions import flow_partitions_ahead

    created = flow_partitions_ahead(now=clock.now())
    if created:
        log.info("created %d flow evidence partitions", created)
    return created


def webhooks_send_step() -> int:
    """Queue a delivery round for each webhook with due deliveries on the sender threads, which work
    each webhook apart (controlplane/webhooks/sender.py); returns at once."""
    from controlplane.webhooks.sender import webhook_rounds_start

    return webhook_rounds_start()


def webhooks_cap_step() -> int:
    """Give up the oldest pending deliveries of a webhook beyond `PALISADE_WEBHOOK_MAX_PENDING`."""
    from controlplane.webhooks.sender import webhook_backlogs_cap

    return webhook_backlogs_cap()


def credential_expiries_step() -> int:
    """`workload.credential_expired` for each credential that expired since the last round."""
    from fleet.credentials import credential_expiries_notice

    return credential_expiries_notice()


def mode_changes_revert_step() -> int:
    """Put back each mode change whose confirmation deadline passed unconfirmed (once, whichever serve
    process gets there first: fleet.mode_confirmations)."""
    from fleet.mode_confirmations import mode_changes_revert_due

    return mode_changes_revert_due()


def webhooks_prune_step() -> int:
    """Finished webhook deliveries past their retention (`PALISADE_WEBHOOK_RETENTION_DAYS`)."""
    from django.conf import settings

    from controlplane.webhooks.services import webhook_deliveries_prune

    pruned = webhook_deliveries_prune(older_than=timedelta(days=settings.PALISADE_WEBHOOK_RETENTION_DAYS))
    if pruned.deliveries or pruned.events:
        log.info("pruned %d finished webhook deliveries and %d events", pruned.deliveries, pruned.events)
    return pruned.deliveries + pruned.events


async def streams_catch_up_step() -> int:
    """Nudge held streams whose change notification was lost or cannot travel (fleet.held_streams)."""
    from fleet.held_streams import streams_catch_up_step

    return await streams_catch_up_step()


@dataclass(frozen=True)
class Step:
    name: str
    every_seconds: float
    run: Callable[[], int] | None = None  # on a thread, with the database
    run_async: Callable[[], Awaitable[int]] | None = None  # on the event loop


def _webhook_send_every() -> float:
    from django.conf import settings

    return settings.PALISADE_WEBHOOK_SEND_EVERY_SECONDS


_WEBHOOK_SEND_EVERY = _webhook_send_every()

STEPS = (
    Step("reap silent streams", 60, run=streams_reap_step),
    Step("prune rendered documents", 600, run=documents_prune_step),
    Step("sum flow windows into hours and blocks", 60, run=flow_windows_sum_step),
    Step("create flow evidence partitions ahead", 3600, run=flow_partitions_step),
    Step("remove flow evidence past its retention", 3600, run=flows_prune_step),
    Step("catch up streams", 2.0, run_async=streams_catch_up_step),
    Step("send webhooks", _WEBHOOK_SEND_EVERY, run=webhooks_send_step),
    Step("cap webhook backlogs", 10, run=webhooks_cap_step),
    Step("notice expired credentials", 30, run=credential_expiries_step),
    # Every second: a 10 s deadline is met within about a second (a serve that was down at the
    # deadline reverts at its first round, a second after it starts).
    Step("revert unconfirmed mode changes", 1, run=mode_changes_revert_step),
    Step("prune webhook deliveries", 3600, run=webhooks_prune_step),
)

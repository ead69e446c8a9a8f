"""Telling open sync streams that something changed: one channel-layer group per connected workload.

Every sender calls `notify_streams` inside its transaction; the messages go out after commit. The
gateway's consumer joins `stream_group(workload_id)` when its stream is authenticated.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from controlplane.channel_layer import layer_call, layer_health

log = logging.getLogger("palisade.fleet")


def stream_group(workload_id) -> str:
    """The channel-layer group of one workload's sync stream."""
    return f"workload.{workload_id}"


# Every serve process holding streams belongs to this group (fleet.held_streams.fleet_receiver_ensure).
# A notification for many workloads goes to it once per chunk, and each process hands it to the
# streams it holds: a fleet-wide change of 10,000 workloads was 10,000 group sends of four Redis
# round trips each, one after the other on the sender's loop, and as many receives.
FLEET_GROUP = "streams.fleet"
FLEET_FROM = 2  # workloads in one notification from which it goes to the fleet group
FLEET_CHUNK = 2_000  # workload ids in one message (about 80 KB)


# The event loop of this `serve` process, which holds the streams. Set once at start; None in
# management commands and tests, where the notification is sent in place instead.
_serving_loop: asyncio.AbstractEventLoop | None = None


def notify_streams_on(loop: asyncio.AbstractEventLoop) -> None:
    """Deliver later notifications on `loop`, the loop serving this process's streams."""
    global _serving_loop
    _serving_loop = loop


def notify_streams(workload_ids: Iterable[str], message: dict) -> None:
    """Send `message` to each workload's stream, once the transaction has committed.

    Inside `serve` the sends are handed to the loop that holds the streams and not waited for: a
    fleet-wide change must not hold the request's thread while thousands of snapshots go out, and
    the in-process channel layer's queues may only be touched from their own loop. Elsewhere (a
    management command) they are sent in place, through Redis when it is configured; without Redis a
    command reaches no stream, and serve's catch-up sweep delivers the change instead. The sweep also
    stands in while the layer is unreachable: sends are then skipped rather than waited for.
    """
    ids = list(workload_ids)
    if not ids:
        return

    if len(ids) >= FLEET_FROM:
        # (group, message, the streams it stands for until the end)
        sends = [
            (
                FLEET_GROUP,
                {"type": "streams.notify", "workload_ids": ids[at : at + FLEET_CHUNK], "event": message},
                len(ids) - at,
            )
            for at in range(0, len(ids), FLEET_CHUNK)
        ]
    else:
        sends = [(stream_group(workload_id), message, len(ids) - at) for at, workload_id in enumerate(ids)]

    async def send_all():
        layer = get_channel_layer()
        if layer is None:
            return
        for group, sent, left in sends:
            if layer_health.down:
                layer_health.failures.report(
                    "notify streams",
                    f"the layer is unreachable: {left} streams are left to the catch-up sweep",
                )
                return
            await layer_call("notify streams", layer.group_send(group, sent))

    def send():
        loop = _serving_loop
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(send_all(), loop).add_done_callback(_log_failure)
        else:
            async_to_sync(send_all)()

    transaction.on_commit(send)


def _log_failure(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("could not notify streams: %s", future.exception())

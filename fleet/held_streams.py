"""The gateway's side of the streams this process holds: the registry of held streams, the sweep that
catches up the ones whose change notification was lost, and the thread pool their database calls run
on. The consumer (fleet/gateway.py) adds and removes streams; serve's housekeeping runs the sweep and
ends every held stream at shutdown.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.db import connection, connections

from controlplane.channel_layer import layer_health
from controlplane.outage import outage
from controlplane.service_identity import gateway_addresses_recorded
from fleet import stream_layer, streams, sync
from fleet.push import FLEET_GROUP

log = logging.getLogger("palisade.gateway")

# On PostgreSQL the stream's database calls run on this pool, not on Channels' one shared thread:
# after a fleet-wide change thousands of streams acknowledge at once, and their writes must overlap.
# Each call is one hop to a pool thread that keeps its connection. database_sync_to_async made a
# second hop per call to close old connections, after which the health check cost a `SELECT 1` per
# call; here a connection is checked (and dropped if broken) only after it raised a database error.
# SQLite takes one writer at a time anyway, so there the calls stay on Channels' thread, serial.
DB_THREADS = 8
_db_pool = ThreadPoolExecutor(DB_THREADS, thread_name_prefix="gateway-db")
_outages_seen = threading.local()


@functools.cache
def _on_postgresql() -> bool:
    # Asked on the event loop for every stream's every database call: through Django's connection
    # proxy (an asgiref Local) that was 4.5 % of the loop's time during a 10,000-agent failover.
    return connection.vendor == "postgresql"


def db(function):
    if not _on_postgresql():
        return database_sync_to_async(function)

    def in_thread(kwargs):
        if connection.errors_occurred:
            connection.close_if_unusable_or_obsolete()
        elif getattr(_outages_seen, "count", 0) != outage.outages and connection.connection is not None:
            # A thread idle through a database outage holds a connection the server dropped: its first
            # call after the outage would fail (and look like a new outage). Checked once per outage.
            if not connection.is_usable():
                connection.close()
        _outages_seen.count = outage.outages
        return function(**kwargs)

    async def call(**kwargs):
        return await asyncio.get_running_loop().run_in_executor(_db_pool, in_thread, kwargs)

    return call


def db_pool_close_connections() -> None:
    """Close the pool threads' database connections (the test suite drops its database after)."""
    everyone = threading.Barrier(DB_THREADS)

    def close():
        connections.close_all()
        everyone.wait(10)  # one task per thread: each waits until every thread has closed its own

    for future in [_db_pool.submit(close) for _ in range(DB_THREADS)]:
        future.result(20)


@dataclass
class HeldStream:
    workload_id: str
    stream_id: str
    sent_version: str | None = None
    # The gateways list this stream was sent; None for an agent that knows one gateway (sent none).
    sent_gateways: tuple[str, ...] | None = None


# The gateways every agent is given, as the last started serve process recorded them; read again at
# each sweep, so that a list changed by another process's start reaches the streams this one holds.
_advertised: tuple[str, ...] = ()


async def gateways_advertised() -> tuple[str, ...]:
    global _advertised
    if not _advertised:
        _advertised = await db(gateway_addresses_recorded)()
    return _advertised


async def gateways_push() -> int:
    """Send the recorded list of gateways to every held stream that was sent another one."""
    global _advertised
    _advertised = await db(gateway_addresses_recorded)()
    pushed = 0
    for channel, stream in list(open_streams.items()):
        if stream.sent_gateways is not None and stream.sent_gateways != _advertised:
            if stream_layer.deliver_locally(
                channel, {"type": "gateways.changed", "addresses": list(_advertised)}
            ):
                stream.sent_gateways = _advertised
                pushed += 1
    if pushed:
        log.info("sent the changed list of gateways (%s) to %d streams", ", ".join(_advertised), pushed)
    return pushed


# The streams this process holds, by channel name: a shutdown records them as ended (a stopping
# server gets no disconnect events from daphne), and the catch-up sweep compares what each was sent
# with its workload's latest version.
open_streams: dict[str, HeldStream] = {}
_behind_at_last_sweep: dict[str, tuple] = {}
_nudged_at_last_sweep: dict[str, tuple] = {}


FLEET_REJOIN_SECONDS = 3600.0  # a group membership expires in the layer after a day


@dataclass
class _FleetMembership:
    """This process's member of the fleet group (fleet.push.FLEET_GROUP): the task receiving its
    notifications, on the layer and channel it receives from."""

    layer: object
    task: asyncio.Task | None = None
    channel: str = ""
    joined_at: float = 0.0


_fleet: _FleetMembership | None = None


def fleet_receiver_ensure() -> None:
    """Belong to the fleet group, on the running loop: serve's catch-up sweep calls it (so from its
    first seconds on), and so does every stream's authentication (the tests' streams have no serve)."""
    global _fleet
    layer = get_channel_layer()
    if layer is None:
        return
    member = _fleet
    if member is not None and member.task is not None:
        task = member.task
        if member.layer is layer and not task.done() and task.get_loop() is asyncio.get_running_loop():
            if member.channel and time.monotonic() - member.joined_at >= FLEET_REJOIN_SECONDS:
                member.joined_at = time.monotonic()
                stream_layer.group_join(layer, member.channel, FLEET_GROUP)
            return
        if not task.get_loop().is_closed():
            task.cancel()
    member = _fleet = _FleetMembership(layer)
    member.task = asyncio.ensure_future(_fleet_receive(member))


async def _fleet_receive(member: _FleetMembership) -> None:
    member.channel = await member.layer.new_channel()
    member.joined_at = time.monotonic()
    stream_layer.group_join(member.layer, member.channel, FLEET_GROUP)
    try:
        await stream_layer.receive_forever(member.layer, member.channel, streams_notified)
    finally:
        stream_layer.groups_forget(member.channel)


def streams_notified(message: dict) -> int:
    """A notification for many workloads (fleet.push): its event to each stream of theirs held here."""
    if message.get("type") != "streams.notify":
        return 0
    wanted = set(message.get("workload_ids") or ())
    event = message.get("event") or {}
    told = 0
    for channel, stream in list(open_streams.items()):
        if stream.workload_id in wanted and stream_layer.deliver_locally(channel, event):
            told += 1
    return told


def streams_end_all() -> int:
    """Record every stream this process holds as ended; called once, as the process stops."""
    held = list(open_streams.values())
    open_streams.clear()
    for stream in held:
        sync.workload_stream_ended(workload_id=stream.workload_id, stream_id=stream.stream_id)
    return len(held)


async def streams_catch_up(*, at_once: bool = False) -> int:
    """Nudge the streams that have been behind their workload for a whole sweep: a latest version
    not sent, a resend not answered by a snapshot, or no longer being the workload's stream.

    Notifications are sent after commit and are not stored; one can be lost (a channel-layer
    hiccup), and a host command in another process without Redis reaches no stream at all. This
    sweep makes every held stream converge anyway, within two sweeps. A stream behind at only one
    sweep is left alone: its notification is most likely still on its way. `at_once` (the channel
    layer is down, or has just come back, so no notification is on its way) nudges every stream
    that is behind now, within one sweep. The nudge goes straight to the stream, never through the
    layer.
    """
    held = dict(open_streams)
    if not held:
        _behind_at_last_sweep.clear()
        _nudged_at_last_sweep.clear()
        return 0
    found = await db(streams.streams_behind)(
        held=[(h.workload_id, h.stream_id, h.sent_version) for h in held.values()]
    )
    behind: dict[str, tuple] = {}
    for channel, stream in held.items():
        if stream.stream_id not in found:
            continue
        due = found[stream.stream_id]
        if due is None:
            # No longer its workload's stream: a newer one took over (whose announcement needs the
            # layer), or its end was recorded while it lived on. It closes; the agent connects again.
            behind[channel] = ("stream.replaced", None)
        elif due.revoked:
            # Stored, not on its way: close it at once, whatever the last sweep saw.
            stream_layer.deliver_locally(channel, {"type": "credential.revoked"})
        elif due.resend_requested_at is not None:
            behind[channel] = ("resend.snapshot", due.resend_requested_at)
        elif due.latest_version and due.latest_version != stream.sent_version:
            behind[channel] = ("policy.updated", due.latest_version)
    if at_once:
        # Not twice for the same reason in a row: with thousands of streams the nudge of the last
        # sweep may still be waiting in its stream's inbox.
        nudge = [
            (channel, why) for channel, why in behind.items() if _nudged_at_last_sweep.get(channel) != why
        ]
        behind = {}
    else:
        nudge = [
            (channel, why) for channel, why in behind.items() if _behind_at_last_sweep.get(channel) == why
        ]
    _behind_at_last_sweep.clear()
    _behind_at_last_sweep.update(behind)
    _nudged_at_last_sweep.clear()
    _nudged_at_last_sweep.update(nudge)
    for channel, (event, _) in nudge:
        stream_layer.deliver_locally(channel, {"type": event})
    if nudge:
        log.info("caught up %d streams whose change notification did not arrive", len(nudge))
    return len(nudge)


_recoveries_seen = 0


async def streams_catch_up_step() -> int:
    """serve's sweep: check the channel layer is there, then catch up; at once while it is away, when
    no notification can be on its way, and on the first sweep after it comes back."""
    global _recoveries_seen
    await stream_layer.layer_check()
    fleet_receiver_ensure()
    came_back = layer_health.recoveries != _recoveries_seen
    _recoveries_seen = layer_health.recoveries
    caught_up = await streams_catch_up(at_once=came_back or layer_health.down)
    await gateways_push()
    return caught_up

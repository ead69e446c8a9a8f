"""A sync stream's use of the channel layer, best effort: the stream never depends on it.

Channels' consumer blocks in `group_add` and runs its receive loop on the layer; with Redis away the
loop raised and took every stream of the process with it (measured: all of them, and reconnecting
agents too). `LayerIndependentConsumer` runs a consumer on a local inbox instead: the layer's receive
pumps into it in the background and waits while the layer is down, group memberships are joined in
the background and joined again when the layer comes back (a restarted Redis forgets them), and this
process's catch-up sweep delivers into the inbox directly. What cannot travel while the layer is
down, the sweep delivers from the database (fleet.held_streams).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from channels.exceptions import StopConsumer
from channels.layers import get_channel_layer
from channels.utils import await_many_dispatch

from controlplane.channel_layer import PING_SECONDS, layer_call, layer_health

log = logging.getLogger("palisade.gateway")

# While the layer is down a stream's receive waits for it to come back (serve pings it every sweep);
# without anyone to notice, it tries again after this long.
RECEIVE_RETRY_SECONDS = 30.0
# How long authenticating waits for the group to be joined before it sends the snapshot, so that a
# change committed in between is not missed; never waited for while the layer is down.
JOIN_WAIT_SECONDS = 1.0
REJOIN_AT_ONCE = 100

_inboxes: dict[str, asyncio.Queue] = {}  # channel name -> the consumer's inbox, for this process's streams
_groups: dict[str, set[str]] = {}  # channel name -> the groups it belongs to
_tasks: set[asyncio.Task] = set()


def deliver_locally(channel_name: str, message: dict) -> bool:
    """Hand `message` to a consumer of this process without the layer; False when it has ended."""
    inbox = _inboxes.get(channel_name)
    if inbox is None:
        return False
    inbox.put_nowait(message)
    return True


def _in_background(coroutine) -> asyncio.Task:
    task = asyncio.ensure_future(coroutine)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


async def layer_check() -> None:
    """Ping the layer: notices it going away before a stream does, and coming back (which rejoins
    the groups)."""
    layer = get_channel_layer()
    ping = getattr(layer, "ping", None)
    if ping is None:
        return
    if layer_health.down and hasattr(layer, "drop_idle_connections"):
        try:  # not a layer_call: it does not reach Redis, so it proves nothing about it
            await asyncio.wait_for(layer.drop_idle_connections(), PING_SECONDS)
        except Exception as error:  # noqa: BLE001 - closing dead sockets may fail; the ping still decides
            layer_health.failures.report("drop its connections", error)
    await layer_call("reach the channel layer", ping(), timeout=PING_SECONDS, ping=True)


async def groups_rejoin() -> int:
    """Join every group this process's streams belong to again: a restarted Redis has none."""
    layer = get_channel_layer()
    pairs = [(group, channel) for channel, groups in list(_groups.items()) for group in groups]
    joined = 0
    for start in range(0, len(pairs), REJOIN_AT_ONCE):
        batch = pairs[start : start + REJOIN_AT_ONCE]
        done = await asyncio.gather(*(layer_call("join a group", layer.group_add(g, c)) for g, c in batch))
        joined += sum(done)
        if not all(done):
            break  # away again; its return rejoins
    if pairs:
        log.info("rejoined %d of %d stream groups", joined, len(pairs))
    return joined


layer_health.on_recovery(groups_rejoin)


async def receive_forever(layer, channel_name: str, handle: Callable[[dict], object]) -> None:
    """Hand every message of `channel_name` to `handle`; while the layer is away, wait for it."""
    while True:
        await layer_health.wait_up(RECEIVE_RETRY_SECONDS)
        try:
            message = await layer.receive(channel_name)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - Redis away: the stream carries on without it
            layer_health.failed("receive stream events", error)
            if not layer_health.down:  # a fault of the layer's own, not its absence: not in a spin
                await asyncio.sleep(1)
            continue
        layer_health.worked()
        handle(message)


def group_join(layer, channel_name: str, group: str, *, announce: dict | None = None) -> asyncio.Task | None:
    """Record `channel_name` as a member of `group` and join it in the background (first sending
    `announce` to the group); None when there is nothing to join now. A layer that comes back joins
    every recorded membership again (groups_rejoin)."""
    _groups.setdefault(channel_name, set()).add(group)
    if layer is None or layer_health.down:
        return None

    async def join():
        if announce is not None:
            await layer_call("tell a group", layer.group_send(group, announce))
        await layer_call("join a group", layer.group_add(group, channel_name))

    return _in_background(join())


def groups_forget(channel_name: str) -> set[str]:
    """Stop recording `channel_name`'s memberships; the groups it was in."""
    return _groups.pop(channel_name, set())


class LayerIndependentConsumer:
    """A mixin for channels' AsyncConsumer: the consumer runs whether the channel layer answers or not.

    Its events arrive on a local inbox; `join_group` and `leave_groups` are best effort, and
    `stream_finished` runs when the application ends, however it ends (a close, a failure, shutdown).
    """

    channel_layer_alias: str

    async def __call__(self, scope, receive, send):
        # channels.consumer.AsyncConsumer.__call__, with the layer's receive moved off the dispatch loop.
        self.scope = scope
        self.base_send = send
        self.channel_layer = get_channel_layer(self.channel_layer_alias)
        if self.channel_layer is not None:
            self.channel_name = await self.channel_layer.new_channel()  # local: no round trip
        else:
            self.channel_name = f"local!{uuid.uuid4().hex}"
        inbox: asyncio.Queue = asyncio.Queue()
        _inboxes[self.channel_name] = inbox
        pump = asyncio.ensure_future(self._pump(inbox)) if self.channel_layer is not None else None
        try:
            await await_many_dispatch([receive, inbox.get], self.dispatch)
        except StopConsumer:
            pass
        finally:
            _inboxes.pop(self.channel_name, None)
            if pump is not None:
                pump.cancel()
            self.leave_groups()
            await self.stream_finished()

    async def _pump(self, inbox: asyncio.Queue) -> None:
        await receive_forever(self.channel_layer, self.channel_name, inbox.put_nowait)

    async def join_group(self, group: str, *, announce: dict | None = None) -> None:
        """Belong to `group` (and first send it `announce`), in the background; waits a moment for it
        while the layer is up, so that what is sent next is not older than the membership."""
        joining = group_join(self.channel_layer, self.channel_name, group, announce=announce)
        if joining is not None and not layer_health.down:
            await asyncio.wait({joining}, timeout=JOIN_WAIT_SECONDS)

    def refresh_groups(self) -> None:
        """Join this consumer's groups again (a membership expires in the layer after a day)."""
        layer = self.channel_layer
        for group in _groups.get(self.channel_name, ()):
            if layer is not None and not layer_health.down:
                _in_background(layer_call("join a group", layer.group_add(group, self.channel_name)))

    def leave_groups(self) -> None:
        groups = groups_forget(self.channel_name)
        layer = self.channel_layer
        if layer is None or layer_health.down:
            return  # nothing to tell; the layer expires the membership itself
        for group in groups:
            _in_background(layer_call("leave a group", layer.group_discard(group, self.channel_name)))

    async def stream_finished(self) -> None:
        """Called once the application ends, however it ends."""

"""The channel layers: ProcessChannelLayer for one `serve`, BoundedRedisChannelLayer for several.

BoundedRedisChannelLayer: channels-redis' default pool raises once more than 100 connections are busy and inherits redis-py's
5 s socket timeout, equal to the layer's own 5 s blocking read: under a few thousand agents
consumers then die with 1011 (measured with channels-redis 4.3 and redis-py 8.1). A bounded blocking pool that
waits for a free connection, with a socket timeout well above the blocking read, holds 5,000 agents.

`layer_health` and `layer_call`: nothing may depend on the layer being reachable. A stream keeps
working while Redis is away (fleet.stream_layer), a notification that cannot travel is left to the
catch-up sweep (fleet.held_streams), and the failures are a few log lines, not one per call.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable

from channels.layers import InMemoryChannelLayer
from channels_redis.core import RedisChannelLayer
from redis import asyncio as aioredis

log = logging.getLogger("palisade.channels")

POOL_SIZE = 200
SOCKET_TIMEOUT_SECONDS = 30
# channels-redis bounds the messages waiting per Redis key, and every consumer of one process shares
# one key: at the default 100, a fleet-wide change dropped the notifications of all but about a
# hundred of a process's streams (measured: 75 of 150 just after Redis came back), which then waited
# for the catch-up sweep. A notification is a few dozen bytes.
CAPACITY = 20_000
# A best-effort call gives up after this: a Redis that is stopped (not gone) answers nothing, and
# would hold each call for the whole socket timeout.
LAYER_CALL_SECONDS = 5.0
# A slow answer is not an absent Redis: under a few thousand agents a busy event loop or a queue for
# the pool takes seconds (measured: a 1 s ping and a 5 s group_send timed out with Redis well). Only
# the ping decides on silence, and only when it goes unanswered this many times in a row.
PING_SECONDS = 2.0
SILENT_PINGS = 2
LOG_EVERY_SECONDS = 60.0


class BoundedRedisChannelLayer(RedisChannelLayer):
    def __init__(self, *args, capacity: int = CAPACITY, **kwargs):
        super().__init__(*args, capacity=capacity, **kwargs)

    def create_pool(self, index):
        host = dict(self.hosts[index])
        address = host.pop("address", None)
        options = {
            "max_connections": POOL_SIZE,
            "timeout": None,
            "socket_timeout": SOCKET_TIMEOUT_SECONDS,
            **host,
        }
        if address:
            return aioredis.BlockingConnectionPool.from_url(address, **options)
        return aioredis.BlockingConnectionPool(**options)

    async def ping(self) -> None:
        for index in range(self.ring_size):
            await self.connection(index).ping()

    async def drop_idle_connections(self) -> None:
        """Disconnect the pooled connections no call is using: while Redis is away they lead nowhere,
        and once it is back each would fail its first call (seen as the layer going away again)."""
        for index in range(self.ring_size):
            await self.connection(index).connection_pool.disconnect(inuse_connections=False)


class ProcessChannelLayer(InMemoryChannelLayer):
    """The channel layer of one `serve` process, with channels' expiry sweep amortised.

    InMemoryChannelLayer walks every channel and every group on each receive and each group_send;
    with thousands of connected agents a fleet-wide change became quadratic (measured: a sixth of
    the event loop's time during a 2,000-agent mode change). Expiry is a minute-scale matter, so
    sweeping at most once a second changes nothing an agent can notice.
    """

    SWEEP_EVERY_SECONDS = 1.0
    _swept_at = 0.0

    def _clean_expired(self):
        now = time.monotonic()
        if now - self._swept_at >= self.SWEEP_EVERY_SECONDS:
            self._swept_at = now
            super()._clean_expired()

    async def ping(self) -> None:
        """Always reachable: it lives in this process."""


class FailureLog:
    """One warning per kind of failure per interval, saying how many more there were in between:
    with Redis away every stream fails the same way, and thousands of identical lines hide the one
    that matters."""

    def __init__(self, every_seconds: float = LOG_EVERY_SECONDS):
        self.every_seconds = every_seconds
        self._logged_at: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def report(self, kind: str, error: BaseException | str) -> bool:
        now = time.monotonic()
        logged_at = self._logged_at.get(kind)
        if logged_at is not None and now - logged_at < self.every_seconds:
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return False
        self._logged_at[kind] = now
        left_out = self._left_out.pop(kind, 0)
        more = (
            f" ({left_out} more like it in the last {now - logged_at:.0f} s)"
            if left_out and logged_at
            else ""
        )
        log.warning("channel layer: cannot %s: %s%s", kind, _first_line(error), more)
        return True


class LayerHealth:
    """Whether this process's channel layer is believed reachable.

    A call that fails (refused, reset, closed) marks it down, and so do SILENT_PINGS unanswered pings
    in a row (a paused Redis accepts connections and answers nothing); any call that works (serve
    pings it with every catch-up sweep) marks it up again, and then the recovery hooks run: the
    streams rejoin their groups, which a restarted Redis has forgotten.
    """

    def __init__(self) -> None:
        self.down_since: float | None = None
        self.recoveries = 0  # how many times it came back, for whoever wants to notice
        self.silent_pings = 0
        self.failures = FailureLog()
        self._hooks: list[Callable[[], Awaitable[object]]] = []
        self._up_events: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._tasks: set[asyncio.Task] = set()

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def on_recovery(self, hook: Callable[[], Awaitable[object]]) -> None:
        if hook not in self._hooks:
            self._hooks.append(hook)

    def failed(self, kind: str, error: BaseException | str) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning(
                "channel layer unreachable (%s: %s): streams stay open; changes reach them by the catch-up sweep",
                kind,
                _first_line(error),
            )
            return
        self.failures.report(kind, error)

    def worked(self) -> None:
        if self.down_since is None:
            return
        log.warning("channel layer reachable again after %.0f s", time.monotonic() - self.down_since)
        self.down_since = None
        self.recoveries += 1
        for event in list(self._up_events.values()):
            event.set()
        self._up_events.clear()
        for hook in self._hooks:
            task = asyncio.ensure_future(hook())
            self._tasks.add(task)
            task.add_done_callback(self._hook_done)

    def _hook_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("after the channel layer came back: %s", _first_line(task.exception()))

    async def wait_up(self, timeout: float) -> None:
        """Until the layer is believed up again, or `timeout` seconds."""
        if self.down_since is None:
            return
        loop = asyncio.get_running_loop()
        event = self._up_events.get(loop)
        if event is None:
            event = self._up_events[loop] = asyncio.Event()
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass


layer_health = LayerHealth()


async def layer_call(
    kind: str, call: Awaitable[object], *, timeout: float = LAYER_CALL_SECONDS, ping: bool = False
) -> bool:
    """Await one channel-layer call without depending on it: False (and a note in `layer_health`)
    when it failed or took longer than `timeout`. A timeout marks the layer down only for a `ping`."""
    try:
        await asyncio.wait_for(call, timeout)
    except asyncio.CancelledError:
        raise
    except TimeoutError as error:
        if ping:
            layer_health.silent_pings += 1
        if ping and layer_health.silent_pings >= SILENT_PINGS:
            layer_health.failed(kind, f"no answer to {layer_health.silent_pings} pings of {timeout:.0f} s")
        else:
            layer_health.failures.report(kind, error)
        return False
    except Exception as error:  # noqa: BLE001 - Redis refused, reset or closed: the caller carries on
        layer_health.failed(kind, error)
        return False
    layer_health.silent_pings = 0
    layer_health.worked()
    return True


def _first_line(error: BaseException | str) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

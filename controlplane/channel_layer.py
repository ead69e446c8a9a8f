"""The channel layers: ProcessChannelLayer for one `serve`, BoundedRedisChannelLayer for several.

BoundedRedisChannelLayer: channels-redis' default pool raises once more than 100 connections are busy and inherits redis-py's
5 s socket timeout, equal to the layer's own 5 s blocking read: under a few thousand agents
consumers then die with 1011 (measured, see notes-from-probes.md). A bounded blocking pool that
waits for a free connection, with a socket timeout well above the blocking read, holds 5,000 agents.
"""

import time

from channels.layers import InMemoryChannelLayer
from channels_redis.core import RedisChannelLayer
from redis import asyncio as aioredis

POOL_SIZE = 200
SOCKET_TIMEOUT_SECONDS = 30


class BoundedRedisChannelLayer(RedisChannelLayer):
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

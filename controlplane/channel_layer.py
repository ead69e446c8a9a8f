"""The Redis channel layer that several `serve` processes share.

channels-redis' default pool raises once more than 100 connections are busy and inherits redis-py's
5 s socket timeout, equal to the layer's own 5 s blocking read: under a few thousand agents
consumers then die with 1011 (measured, see notes-from-probes.md). A bounded blocking pool that
waits for a free connection, with a socket timeout well above the blocking read, holds 5,000 agents.
"""

from channels_redis.core import RedisChannelLayer
from redis import asyncio as aioredis

POOL_SIZE = 200
SOCKET_TIMEOUT_SECONDS = 30


class BoundedRedisChannelLayer(RedisChannelLayer):
    def create_pool(self, index):
        host = dict(self.hosts[index])
        address = host.pop("address", None)
        options = {"max_connections": POOL_SIZE, "timeout": None, "socket_timeout": SOCKET_TIMEOUT_SECONDS, **host}
        if address:
            return aioredis.BlockingConnectionPool.from_url(address, **options)
        return aioredis.BlockingConnectionPool(**options)

"""The Redis channel layer carries a group message from one layer instance (process) to another."""

import os

import pytest
from asgiref.sync import async_to_sync

from controlplane.channel_layer import BoundedRedisChannelLayer
from tests.support.requirements import require

REDIS_URL = os.environ.get("REDIS_TEST_URL", "redis://127.0.0.1:6379/0")


def redis_reachable() -> bool:
    import redis

    try:
        return redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError:
        return False


@pytest.mark.timeout(30)
def test_group_send_crosses_layer_instances():
    require(redis_reachable(), f"needs Redis at {REDIS_URL} (set REDIS_TEST_URL)")
    sender = BoundedRedisChannelLayer(hosts=[REDIS_URL], prefix="palisade-test")
    receiver = BoundedRedisChannelLayer(hosts=[REDIS_URL], prefix="palisade-test")

    async def scenario():
        channel = await receiver.new_channel()
        await receiver.group_add("workload.test", channel)
        await sender.group_send("workload.test", {"type": "resend.snapshot"})
        message = await receiver.receive(channel)
        await receiver.group_discard("workload.test", channel)
        await sender.flush()
        await receiver.flush()
        return message

    assert async_to_sync(scenario)() == {"type": "resend.snapshot"}
    pool = sender.create_pool(0)
    assert pool.max_connections == 200 and pool.timeout is None
    assert sender.capacity == 20_000  # per process, not per stream: see controlplane/channel_layer.py

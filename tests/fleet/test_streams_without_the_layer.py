"""A sync stream does not depend on the channel layer: with its Redis unreachable the stream opens,
stays open and is caught up from the database; a stream that ends however it ends (here its
application fails) is recorded offline. The real consumer, and a real Redis layer pointed at a port
nothing listens on; tests/e2e/test_streams_without_redis.py stops a real Redis under two serves."""

import logging
import socket

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async

from agent import protocol
from controlplane.channel_layer import FailureLog, layer_health
from fleet import held_streams, sync
from tests.support.gateway_stream import FINGERPRINT, Agent, open_stream, receive
from tests.support.gateway_stream import enforced as _enforce
from tests.support.gateway_stream import stream_state as _state
from tests.support.serve_process import free_port


@pytest.fixture(autouse=True)
def gateway_fingerprint():
    from controlplane import runtime

    runtime.facts_set(gateway_fingerprint=FINGERPRINT)


@pytest.fixture
def healthy_again():
    """The layer's health is one per process: what a test learnt must not leak into the next."""
    yield
    layer_health.down_since = None
    layer_health.silent_pings = 0


@pytest.fixture
def unreachable_redis(settings, healthy_again):
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "controlplane.channel_layer.BoundedRedisChannelLayer",
            "CONFIG": {"hosts": [f"redis://127.0.0.1:{free_port()}/0"]},
        }
    }


@pytest.mark.django_db(transaction=True)
def test_a_stream_opens_and_is_caught_up_while_its_redis_is_unreachable(unreachable_redis):
    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent)
        assert isinstance(await receive(communicator), protocol.Welcome)
        first = await receive(communicator)
        assert isinstance(first, protocol.Snapshot)
        await communicator.send_to(text_data=protocol.Applied(version=first.version).encode())
        await database_sync_to_async(_enforce)(agent)  # its notification cannot travel
        assert layer_health.down
        assert await held_streams.streams_catch_up_step() == 1  # at once: nothing else is on its way
        second = await receive(communicator)
        assert isinstance(second, protocol.Snapshot) and second.mode == "enforced"
        await communicator.send_to(text_data=protocol.Applied(version=second.version).encode())
        await communicator.disconnect()

    async_to_sync(scenario)()
    assert async_to_sync(_state)(agent)[0] == "offline"


@pytest.mark.django_db(transaction=True)
def test_a_newer_stream_replaces_the_older_without_the_layer(unreachable_redis):
    """The newer stream's announcement cannot travel; the sweep sees the older one is no longer
    its workload's stream."""
    agent = Agent()

    async def scenario():
        old = await open_stream(agent)
        await receive(old)
        await receive(old)
        new = await open_stream(agent)
        await receive(new)
        assert isinstance(await receive(new), protocol.Snapshot)
        assert layer_health.down
        await held_streams.streams_catch_up_step()
        assert await old.receive_output(timeout=5) == {
            "type": "websocket.close",
            "code": protocol.CLOSE_REPLACED,
        }
        await old.disconnect()
        assert (await _state(agent))[0] == "pending"
        await new.disconnect()

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_a_stream_whose_application_fails_is_recorded_offline(monkeypatch, healthy_again):
    agent = Agent()

    def broken(**kwargs):
        raise RuntimeError("injected")

    async def scenario():
        communicator = await open_stream(agent)
        await receive(communicator)
        await receive(communicator)
        assert (await _state(agent))[0] == "pending"
        monkeypatch.setattr(sync, "workload_heard_from", broken)
        heartbeat = protocol.Heartbeat(
            process_start_id="p1", uptime_seconds=2, clock="x", owned_table="absent"
        )
        await communicator.send_to(text_data=heartbeat.encode())
        with pytest.raises(RuntimeError, match="injected"):
            await communicator.receive_output(timeout=2)  # it waits all of it, then raises

    async_to_sync(scenario)()
    assert async_to_sync(_state)(agent)[0] == "offline"
    assert not held_streams.open_streams


def test_a_kind_of_failure_is_logged_once_per_interval_with_how_many_were_left_out(caplog):
    failures = FailureLog(every_seconds=3600)
    with caplog.at_level(logging.WARNING, logger="palisade.channels"):
        for _ in range(100):
            failures.report("receive stream events", ConnectionError("Connection refused"))
        failures.report("join a group", TimeoutError())
    assert [r.getMessage() for r in caplog.records] == [
        "channel layer: cannot receive stream events: Connection refused",
        "channel layer: cannot join a group: TimeoutError",
    ]
    caplog.clear()
    failures.every_seconds = 0
    with caplog.at_level(logging.WARNING, logger="palisade.channels"):
        failures.report("receive stream events", ConnectionError("Connection refused"))
    assert "(99 more like it in the last" in caplog.records[0].getMessage()


def test_a_silent_redis_is_down_after_unanswered_pings_and_a_slow_call_alone_is_not(healthy_again):
    """A paused Redis accepts connections and answers nothing (here: a listener that never reads)."""
    from controlplane.channel_layer import SILENT_PINGS, BoundedRedisChannelLayer, layer_call

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        layer = BoundedRedisChannelLayer(hosts=[f"redis://127.0.0.1:{silent.getsockname()[1]}/0"])

        async def scenario():
            assert not await layer_call("join a group", layer.group_add("g", "c"), timeout=0.2)
            assert not layer_health.down
            for _ in range(SILENT_PINGS - 1):
                assert not await layer_call("ping", layer.ping(), timeout=0.2, ping=True)
            assert not layer_health.down
            assert not await layer_call("ping", layer.ping(), timeout=0.2, ping=True)
            assert layer_health.down

        async_to_sync(scenario)()

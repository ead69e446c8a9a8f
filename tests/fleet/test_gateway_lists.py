"""The gateway's side of several gateways: an agent that names the gateway it dialed gets the list the
last started serve recorded, sees it again when that list changes (the sweep compares), and the workload
says which gateway its stream is on. An agent that knows one gateway gets no such message."""

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async

from agent import protocol
from controlplane import clock, runtime
from controlplane.models import GatewayIdentity
from fleet import held_streams
from fleet.representations import workload_data
from tests.support.gateway_stream import FINGERPRINT, Agent, open_stream, receive, workload

LISTED = ["gw-a.example.test:8443", "gw-b.example.test:8443"]


@pytest.fixture(autouse=True)
def recorded():
    runtime.facts_set(gateway_fingerprint=FINGERPRINT, gateway_advertise=tuple(LISTED))
    GatewayIdentity.objects.update_or_create(
        id=1,
        defaults={
            "address": LISTED[0],
            "addresses": LISTED,
            "fingerprint": FINGERPRINT,
            "updated_at": clock.now(),
        },
    )
    held_streams._advertised = ()
    yield
    held_streams._advertised = ()


@database_sync_to_async
def _shown(agent):
    return workload_data(workload(agent))["sync"]["gateway"]


@database_sync_to_async
def _record(addresses):
    GatewayIdentity.objects.filter(id=1).update(addresses=addresses, address=addresses[0])


@pytest.mark.django_db(transaction=True)
def test_an_agent_that_names_its_gateway_gets_the_list_and_every_change_of_it():
    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent, gateway=LISTED[1])
        assert isinstance(await receive(communicator), protocol.Welcome)
        assert await receive(communicator) == protocol.Gateways(addresses=LISTED)
        assert isinstance(await receive(communicator), protocol.Snapshot)
        assert await _shown(agent) == LISTED[1]

        # Another serve process started with a new list: this one's sweep sends it on.
        changed = [LISTED[1], "gw-c.example.test:9443"]
        await _record(changed)
        assert await held_streams.gateways_push() == 1
        assert await receive(communicator) == protocol.Gateways(addresses=changed)
        assert await held_streams.gateways_push() == 0  # sent once
        await communicator.disconnect()
        assert await _shown(agent) is None  # no stream, no gateway

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_an_agent_that_knows_one_gateway_gets_no_list():
    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent)
        assert isinstance(await receive(communicator), protocol.Welcome)
        assert isinstance(await receive(communicator), protocol.Snapshot)
        await _record(["gw-z.example.test:1"])
        assert await held_streams.gateways_push() == 0
        await communicator.receive_nothing(timeout=0.3)
        assert await _shown(agent) is None
        await communicator.disconnect()

    async_to_sync(scenario)()

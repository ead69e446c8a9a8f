"""An enrolled agent's sync stream on the gateway's websocket application, in process (channels'
WebsocketCommunicator): what the gateway's tests and those of the streams around it share."""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent import protocol
from agent.credential import public_key_encode
from controlplane.auth.actor import CLI_ACTOR
from controlplane.urls_gateway import websocket_application
from fleet.enrolment import workload_enrol
from fleet.models import Workload
from fleet.provisioning import provisioning_token_mint

FINGERPRINT = ":".join(["AB"] * 32)  # the gateway's, as the tests set it in runtime.facts


class Agent:
    def __init__(self, db_token_labels=None, *, hostname="agent-1", address="10.0.0.7"):
        self.key = Ed25519PrivateKey.generate()
        secret = provisioning_token_mint(
            actor=CLI_ACTOR, data={"description": "t", "labels": db_token_labels or {}}
        ).secret
        enrolled = workload_enrol(
            token_secret=secret,
            public_key=public_key_encode(self.key.public_key()),
            hostname=hostname,
            addresses=[address],
            agent_version="0.1.0",
        )
        self.workload_id = str(enrolled.workload.id)
        self.credential = enrolled.credential.text

    def auth(self, nonce_b64, **overrides):
        nonce = protocol.b64decode(nonce_b64, what="nonce")
        values = dict(
            workload_id=self.workload_id,
            credential=self.credential,
            proof=protocol.sign_proof(
                self.key, nonce=nonce, workload_id=self.workload_id, gateway_fingerprint=FINGERPRINT
            ),
            agent_version="0.1.0",
            process_start_id="p1",
            uptime_seconds=1.0,
            owned_table="present",
        )
        values.update(overrides)
        return protocol.Auth(**values).encode()


async def open_stream(agent, **overrides):
    communicator = WebsocketCommunicator(websocket_application, protocol.STREAM_PATH)
    connected, _ = await communicator.connect()
    assert connected
    hello = protocol.decode(await communicator.receive_from(), sender="gateway")
    await communicator.send_to(text_data=agent.auth(hello.nonce, **overrides))
    return communicator


async def receive(communicator):
    return protocol.decode(await communicator.receive_from(timeout=5), sender="gateway")


def workload(agent):
    return Workload.objects.get(id=agent.workload_id)


@database_sync_to_async
def stream_state(agent):
    w = workload(agent)
    return w.sync_state, w.last_snapshot_sent_at, w.owned_table_state


def enforced(agent):
    from fleet.services import mode_change_create

    mode_change_create(
        actor=CLI_ACTOR, data={"selection": {"workload_ids": [agent.workload_id]}, "mode": "enforced"}
    )

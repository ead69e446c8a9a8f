"""Revoking a workload's credential: the API and the host command, the open stream
closing at once, streams, renewals and flow reports refused, the workload still in the fleet showing
why, and the way back only through a token minted for it."""

import json

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent import protocol
from agent.credential import public_key_encode
from controlplane import clock, runtime
from controlplane.auth.actor import CLI_ACTOR
from controlplane.models import AuditEvent
from fleet import held_streams
from fleet.credentials import credential_renew, credential_revoke
from fleet.enrolment import workload_enrol
from fleet.models import Workload
from fleet.provisioning import provisioning_token_mint
from tests.support.gateway_stream import FINGERPRINT, Agent, open_stream, receive
from tests.support.helpers import assert_problem
from tests.support.helpers import run_command as run


@pytest.fixture(autouse=True)
def gateway(settings, tmp_path):
    settings.DATA_DIR = tmp_path
    runtime.facts_set(gateway_fingerprint=FINGERPRINT)


def revoke(agent, reason="compromised"):
    return credential_revoke(actor=CLI_ACTOR, workload_id=agent.workload_id, data={"reason": reason})


def closed_with(code):
    return {"type": "websocket.close", "code": code}


# --- the operator's side --------------------------------------------------------------------------


def test_the_api_revokes_shows_the_revocation_keeps_the_workload_and_audits_once(db, api):
    agent = Agent()
    path = f"/api/v1/workloads/{agent.workload_id}/revoke-credential"
    response = api.post(path, {"reason": "key copied off the host"}, format="json")
    assert response.status_code == 200, response.content
    revoked = response.json()["health"]["credential"]["revoked"]
    assert revoked["reason"] == "key copied off the host" and revoked["at"]
    shown = api.get(f"/api/v1/workloads/{agent.workload_id}").json()
    assert shown["health"]["credential"]["revoked"] == revoked
    again = api.post(path, {"reason": "other"}, format="json")  # harmless; keeps the first
    assert again.json()["health"]["credential"]["revoked"] == revoked
    (event,) = AuditEvent.objects.filter(action="workload.revoke_credential")
    assert event.object_id == agent.workload_id and event.detail["reason"] == "key copied off the host"
    assert Workload.objects.filter(id=agent.workload_id).exists()
    other = Agent()
    assert api.get(f"/api/v1/workloads/{other.workload_id}").json()["health"]["credential"]["revoked"] is None


def test_the_api_refuses_bad_input_and_unknown_workloads(db, api):
    agent = Agent()
    path = f"/api/v1/workloads/{agent.workload_id}/revoke-credential"
    for body, where in [({"reason": 5}, "/reason"), ({"reason": "a\nb"}, "/reason"), ({"why": "x"}, "/why")]:
        problem = assert_problem(api.post(path, body, format="json"), 422, "validation")
        assert [f["path"] for f in problem["errors"]] == [where]
    assert Workload.objects.get(id=agent.workload_id).credential_revoked_at is None
    assert api.post(path).status_code == 200  # no body: no reason
    missing = api.post("/api/v1/workloads/00000000-0000-0000-0000-000000000000/revoke-credential")
    assert_problem(missing, 404, "not-found")


def test_the_host_command_revokes(db):
    agent = Agent()
    code, out, err = run("workload", "revoke-credential", agent.workload_id, "--reason", "stolen")
    assert code in (0, None), err
    assert "revoked the credential of agent-1" in out
    workload = Workload.objects.get(id=agent.workload_id)
    assert workload.credential_revoked_at is not None and workload.credential_revoked_reason == "stolen"
    code, out, err = run("workload", "revoke-credential", "nope")
    assert code != 0 and "nope" in err


# --- the agent's side -----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_open_stream_closes_at_once_and_a_new_one_is_refused():
    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent)
        await receive(communicator)  # welcome
        await receive(communicator)  # snapshot
        await database_sync_to_async(revoke)(agent)
        assert await communicator.receive_output(timeout=5) == closed_with(protocol.CLOSE_CREDENTIAL_REVOKED)
        await communicator.disconnect()  # as daphne reports the close
        again = await open_stream(agent)
        assert await again.receive_output(timeout=5) == closed_with(protocol.CLOSE_CREDENTIAL_REVOKED)

    async_to_sync(scenario)()
    assert Workload.objects.get(id=agent.workload_id).sync_state == "offline"


@pytest.mark.django_db(transaction=True)
def test_a_renewal_after_revocation_closes_the_stream_as_revoked():
    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent)
        await receive(communicator)
        await receive(communicator)
        # Revoked behind the stream's back (no notification): the renewal itself must refuse.
        await database_sync_to_async(
            lambda: Workload.objects.filter(id=agent.workload_id).update(credential_revoked_at=clock.now())
        )()
        await communicator.send_to(text_data=protocol.Renew().encode())
        assert await communicator.receive_output(timeout=5) == closed_with(protocol.CLOSE_CREDENTIAL_REVOKED)

    async_to_sync(scenario)()
    workload = Workload.objects.get(id=agent.workload_id)
    assert workload.credential_serial == 1
    with pytest.raises(Exception) as refused:
        credential_renew(workload_id=agent.workload_id)
    assert refused.value.name == "credential-revoked"


@pytest.mark.django_db(transaction=True)
def test_the_catch_up_sweep_closes_a_revoked_stream_whose_notification_was_lost():
    """A host command without Redis reaches no stream: serve's sweep closes it from the stored state."""
    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent)
        await receive(communicator)
        await receive(communicator)
        await database_sync_to_async(
            lambda: Workload.objects.filter(id=agent.workload_id).update(credential_revoked_at=clock.now())
        )()
        await held_streams.streams_catch_up()
        assert await communicator.receive_output(timeout=5) == closed_with(protocol.CLOSE_CREDENTIAL_REVOKED)

    async_to_sync(scenario)()


@pytest.mark.urls("controlplane.urls_gateway")
def test_flow_reports_are_refused_and_a_token_for_the_workload_brings_it_back(db, client):
    key = Ed25519PrivateKey.generate()
    enrolled = workload_enrol(
        token_secret=provisioning_token_mint(actor=CLI_ACTOR, data={"description": "t"}).secret,
        public_key=public_key_encode(key.public_key()),
        hostname="web",
        addresses=["10.0.0.5"],
        agent_version="0.1.0",
    )
    workload_id = str(enrolled.workload.id)
    body = json.dumps(
        protocol.flow_report(
            agent_clock=clock.rfc3339(clock.now()),
            process_start_id="p",
            uptime_seconds=1.0,
            window_seconds=60,
            windows=[],
            gaps=[],
        )
    ).encode()

    def report(signer, credential):
        signature = protocol.sign_flow_report(
            signer, body=body, workload_id=workload_id, gateway_fingerprint=FINGERPRINT
        )
        return client.post(
            protocol.FLOWS_PATH,
            body,
            content_type="application/json",
            headers={
                "Palisade-Workload": workload_id,
                "Palisade-Credential": credential,
                "Palisade-Signature": signature,
            },
        )

    assert report(key, enrolled.credential.text).status_code == 200
    credential_revoke(actor=CLI_ACTOR, workload_id=workload_id)
    detail = assert_problem(report(key, enrolled.credential.text), 403, "credential-revoked")["detail"]
    assert "minted for it" in detail
    # Back by the operator's consent only: a token minted for this workload.
    new_key = Ed25519PrivateKey.generate()
    token = provisioning_token_mint(actor=CLI_ACTOR, data={"description": "back", "workload_id": workload_id})
    again = workload_enrol(
        token_secret=token.secret,
        public_key=public_key_encode(new_key.public_key()),
        hostname="web",
        addresses=["10.0.0.5"],
        agent_version="0.1.0",
        workload_id=workload_id,
    )
    assert report(new_key, again.credential.text).status_code == 200
    assert report(key, enrolled.credential.text).status_code == 401  # the stolen key stays out

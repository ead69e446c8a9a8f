"""Re-enrolment needs the operator's consent for that one workload, as a hostile
host on the network tries it at POST /agent/v1/enrol: a general token with a victim's id, a token
minted for another workload, a workload token used to create a workload, replayed, stale, re-bound or
foreign key proofs. Every refusal leaves the victim and the token as they were and says why; every
enrolment that happens is an audit event."""

from datetime import timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent import protocol
from agent.credential import format_instant, public_key_encode, public_key_fingerprint
from controlplane import clock, runtime
from controlplane.auth.actor import CLI_ACTOR
from controlplane.models import AuditEvent
from fleet.credentials import credential_revoke
from fleet.enrolment import workload_enrol
from fleet.models import ProvisioningToken, Workload
from fleet.provisioning import provisioning_token_mint
from tests.support.helpers import assert_problem

FINGERPRINT = ":".join(["AB"] * 32)
pytestmark = pytest.mark.urls("controlplane.urls_gateway")


@pytest.fixture(autouse=True)
def gateway(settings, tmp_path, db):
    settings.DATA_DIR = tmp_path
    runtime.facts_set(gateway_fingerprint=FINGERPRINT, gateway_advertise=("gw.example.test:8443",))


def mint(**data) -> str:
    return provisioning_token_mint(actor=CLI_ACTOR, data={"description": "t", **data}).secret


class Host:
    """An agent host: its key, and the workload it enrolled."""

    def __init__(self, token: str | None = None, hostname="web-1", addresses=("10.0.0.5",)):
        self.key = Ed25519PrivateKey.generate()
        enrolled = workload_enrol(
            token_secret=token or mint(labels={"app": "web"}),
            public_key=public_key_encode(self.key.public_key()),
            hostname=hostname,
            addresses=list(addresses),
            agent_version="0.1.0",
        )
        self.workload_id = str(enrolled.workload.id)

    def row(self) -> Workload:
        return Workload.objects.get(id=self.workload_id)


def request_body(
    *, key=None, token="", workload_id=None, hostname="attacker", addresses=("10.9.9.9",), proof=None
):
    key = key or Ed25519PrivateKey.generate()
    body = {
        "v": 1,
        "token": token,
        "public_key": public_key_encode(key.public_key()),
        "hostname": hostname,
        "addresses": list(addresses),
        "agent_version": "0.1.0",
    }
    if workload_id is not None:
        body["workload_id"] = workload_id
    if proof is not None:
        body["key_proof"] = proof
    return body


def key_proof(signer, body, *, serial=None, signed_at=None, fingerprint=FINGERPRINT, **changed):
    """A key proof over `body` (with `changed` fields signed instead of the body's)."""
    content = {
        "workload_id": body["workload_id"],
        "public_key": body["public_key"],
        "hostname": body["hostname"],
        "addresses": body["addresses"],
        **changed,
    }
    if serial is None:
        serial = Workload.objects.get(id=body["workload_id"]).credential_serial
    return protocol.sign_key_proof(
        signer,
        serial=serial,
        signed_at=signed_at or format_instant(clock.now()),
        gateway_fingerprint=fingerprint,
        **content,
    )


def post(client, body):
    return client.post(protocol.ENROL_PATH, body, content_type="application/json")


def unchanged(victim: Host, before: Workload) -> None:
    after = victim.row()
    assert (after.public_key, after.hostname, after.addresses, after.credential_serial) == (
        before.public_key,
        before.hostname,
        before.addresses,
        before.credential_serial,
    )


def enrol_events():
    return list(AuditEvent.objects.filter(action__in=["workload.enrol", "workload.re_enrol"]).order_by("at"))


# --- tokens ---------------------------------------------------------------------------------------


def test_a_general_token_cannot_take_over_a_workload(client, caplog):
    victim = Host()
    before = victim.row()
    general = mint(labels={"sandbox": "dev"}, max_uses=1)
    body = assert_problem(
        post(client, request_body(token=general, workload_id=victim.workload_id)), 403, "enrolment-refused"
    )
    assert "general token" in body["detail"] and "minted for it" in body["detail"]
    unchanged(victim, before)
    assert ProvisioningToken.objects.get(prefix=general[:12]).uses == 0
    assert len(enrol_events()) == 1  # the victim's own enrolment only
    assert f"refused an enrolment from 127.0.0.1 for workload '{victim.workload_id}'" in caplog.text


def test_a_token_minted_for_one_workload_neither_re_enrols_another_nor_creates_one(client):
    a, b = Host(hostname="a"), Host(hostname="b", addresses=("10.0.0.6",))  # one address, one workload
    before = b.row()
    for_a = mint(workload_id=a.workload_id)
    body = assert_problem(
        post(client, request_body(token=for_a, workload_id=b.workload_id)), 403, "enrolment-refused"
    )
    assert f"minted for workload {a.workload_id}" in body["detail"]
    unchanged(b, before)
    body = assert_problem(post(client, request_body(token=for_a)), 403, "enrolment-refused")
    assert "enrols nothing else" in body["detail"]
    assert Workload.objects.count() == 2
    assert ProvisioningToken.objects.get(workload_id=a.workload_id).uses == 0


def test_a_token_minted_for_the_workload_re_enrols_it_once_and_is_audited(client):
    victim = Host()
    before = victim.row()
    token = mint(workload_id=victim.workload_id)
    new_key = Ed25519PrivateKey.generate()
    body = request_body(key=new_key, token=token, workload_id=victim.workload_id, hostname="web-1-rebuilt")
    response = post(client, body)
    assert response.status_code == 201, response.content
    after = victim.row()
    assert after.public_key == body["public_key"] and after.addresses == ["10.9.9.9"]
    assert after.labels == {"app": "web"} and after.credential_serial == before.credential_serial + 1
    record = ProvisioningToken.objects.get(workload_id=victim.workload_id)
    assert (record.uses, record.max_uses) == (1, 1)
    event = enrol_events()[-1]
    assert event.action == "workload.re_enrol" and event.object_id == victim.workload_id
    assert event.actor_kind == "agent" and record.prefix in event.actor
    assert event.detail["via"] == "token" and event.detail["token_id"] == str(record.id)
    assert event.detail["old_public_key_fingerprint"] == public_key_fingerprint(before.public_key)
    assert event.detail["public_key_fingerprint"] == public_key_fingerprint(body["public_key"])
    assert event.detail["old_addresses"] == ["10.0.0.5"] and event.detail["addresses"] == ["10.9.9.9"]
    assert event.detail["old_hostname"] == "web-1" and event.detail["hostname"] == "web-1-rebuilt"
    # One use: the same token again is used up.
    again = post(client, request_body(token=token, workload_id=victim.workload_id))
    assert "used up" in assert_problem(again, 401, "unauthenticated")["detail"]
    assert victim.row().public_key == body["public_key"]


def test_a_new_enrolment_is_audited_with_its_token(client):
    token = mint(labels={"app": "db"})
    response = post(client, request_body(token=token, hostname="db-1", addresses=["10.1.0.1"]))
    assert response.status_code == 201, response.content
    (event,) = enrol_events()
    assert event.action == "workload.enrol" and event.object_id == response.json()["workload_id"]
    assert event.detail["token_prefix"] == token[:12] and event.detail["addresses"] == ["10.1.0.1"]


def test_re_enrolment_without_token_or_proof_is_refused(client):
    victim = Host()
    response = post(client, request_body(workload_id=victim.workload_id))
    assert "neither" in assert_problem(response, 401, "unauthenticated")["detail"]


@pytest.mark.parametrize("workload_id", [5, ["x"], {"a": 1}, "", "not-a-uuid"])
def test_a_mistyped_workload_id_is_a_problem_not_a_crash(client, workload_id):
    response = post(client, request_body(token=mint(), workload_id=workload_id))
    assert response.status_code in (404, 422), response.content


# --- the workload's own key -----------------------------------------------------------------------


def test_the_agent_rotates_its_own_key_with_a_proof_signed_by_the_current_key(client):
    host = Host()
    before = host.row()
    general = mint()  # carried along, not used: the key proof suffices
    body = request_body(token=general, workload_id=host.workload_id, hostname="web-1", addresses=["10.0.0.6"])
    body["key_proof"] = key_proof(host.key, body)
    response = post(client, body)
    assert response.status_code == 201, response.content
    after = host.row()
    assert after.public_key == body["public_key"] and after.addresses == ["10.0.0.6"]
    assert after.credential_serial == before.credential_serial + 1
    assert after.enrolled_with_id == before.enrolled_with_id
    assert ProvisioningToken.objects.get(prefix=general[:12]).uses == 0
    event = enrol_events()[-1]
    assert event.detail["via"] == "key" and "token_id" not in event.detail
    assert event.detail["old_public_key_fingerprint"] == public_key_fingerprint(before.public_key)


def test_a_replayed_key_proof_is_refused(client):
    host = Host()
    body = request_body(workload_id=host.workload_id)
    body["key_proof"] = key_proof(host.key, body)
    assert post(client, body).status_code == 201
    rotated = host.row()
    detail = assert_problem(post(client, body), 401, "unauthenticated")["detail"]
    assert "serial" in detail
    unchanged(host, rotated)


def test_a_proof_is_good_for_one_enrolment_even_when_the_key_stays(client):
    """Replaying a rotation to the same key would verify again but for the serial it names: each
    enrolment moves the serial on, and a replay would otherwise revoke the agent's newer credential."""
    host = Host()
    body = request_body(key=host.key, workload_id=host.workload_id)
    body["key_proof"] = key_proof(host.key, body)
    assert post(client, body).status_code == 201
    current = host.row()
    assert "serial" in assert_problem(post(client, body), 401, "unauthenticated")["detail"]
    unchanged(host, current)


def test_a_proof_signed_by_another_workloads_key_is_refused(client):
    victim, attacker = Host(hostname="victim"), Host(hostname="attacker", addresses=("10.0.0.6",))
    before = victim.row()
    body = request_body(workload_id=victim.workload_id)
    body["key_proof"] = key_proof(attacker.key, body)
    assert "does not verify" in assert_problem(post(client, body), 401, "unauthenticated")["detail"]
    unchanged(victim, before)


@pytest.mark.parametrize(
    "tamper",
    [
        {"addresses": ["10.0.0.5"]},  # signed other addresses than the request carries
        {"hostname": "web-1"},
        {"public_key": public_key_encode(Ed25519PrivateKey.generate().public_key())},
        {"fingerprint": ":".join(["CD"] * 32)},  # signed for another gateway
    ],
    ids=["addresses", "hostname", "public_key", "gateway"],
)
def test_a_proof_is_bound_to_the_requests_content_and_the_gateway(client, tamper):
    host = Host()
    before = host.row()
    body = request_body(workload_id=host.workload_id)
    body["key_proof"] = key_proof(host.key, body, **tamper)
    assert_problem(post(client, body), 401, "unauthenticated")
    unchanged(host, before)


@pytest.mark.parametrize("age", [timedelta(minutes=6), -timedelta(minutes=6)], ids=["old", "future"])
def test_a_proof_signed_too_far_from_now_is_refused(client, age):
    host = Host()
    body = request_body(workload_id=host.workload_id)
    body["key_proof"] = key_proof(host.key, body, signed_at=format_instant(clock.now() - age))
    assert "check the host's clock" in assert_problem(post(client, body), 401, "unauthenticated")["detail"]


def test_a_key_proof_beyond_the_grace_is_refused(client, clock_at):
    host = Host()
    clock_at(timedelta(days=30, hours=73))
    body = request_body(workload_id=host.workload_id)
    body["key_proof"] = key_proof(host.key, body)
    assert "grace" in assert_problem(post(client, body), 401, "unauthenticated")["detail"]


@pytest.mark.parametrize(
    "proof, path",
    [
        ("yes", "/key_proof"),
        ({"serial": 0, "signed_at": "x", "signature": "s"}, "/key_proof/serial"),
        ({"serial": 1, "signed_at": "yesterday", "signature": "s"}, "/key_proof/signed_at"),
        (
            {"serial": 1, "signed_at": "2026-01-01T00:00:00Z", "signature": "s", "nonce": 1},
            "/key_proof/nonce",
        ),
    ],
)
def test_a_malformed_key_proof_is_a_validation_problem(client, proof, path):
    host = Host()
    body = assert_problem(
        post(client, request_body(workload_id=host.workload_id, proof=proof)), 422, "validation"
    )
    assert path in [finding["path"] for finding in body["errors"]]


def test_a_key_proof_does_not_create_a_workload(client):
    body = request_body(
        token=mint(), proof={"serial": 1, "signed_at": format_instant(clock.now()), "signature": "x"}
    )
    assert_problem(post(client, body), 422, "validation")
    assert not Workload.objects.exists()


# --- after a revocation ---------------------------------------------------------------------------


def test_after_revocation_the_key_rotates_nothing_and_only_a_token_for_the_workload_brings_it_back(client):
    host = Host()
    credential_revoke(actor=CLI_ACTOR, workload_id=host.workload_id, data={"reason": "key stolen"})
    before = host.row()
    body = request_body(token=mint(), workload_id=host.workload_id)
    body["key_proof"] = key_proof(host.key, body)
    detail = assert_problem(post(client, body), 403, "credential-revoked")["detail"]
    assert "key stolen" in detail and "minted for it" in detail
    unchanged(host, before)
    # The operator's consent: a token minted for it, also alongside a refused key proof.
    body["token"] = mint(workload_id=host.workload_id)
    response = post(client, body)
    assert response.status_code == 201, response.content
    after = host.row()
    assert after.credential_revoked_at is None and after.credential_revoked_reason == ""
    assert enrol_events()[-1].detail["cleared_revocation"] == clock.rfc3339(before.credential_revoked_at)


def test_a_revocation_and_its_reason_are_told_only_to_whom_proves_the_key(client):
    """A stranger who knows the workload's id (ids are not secret) learns nothing of its revocation
    from a proof signed with another key: the proof is checked first."""
    host, stranger = Host(), Host(hostname="stranger", addresses=("10.0.0.6",))
    credential_revoke(actor=CLI_ACTOR, workload_id=host.workload_id, data={"reason": "key stolen"})
    before = host.row()
    body = request_body(workload_id=host.workload_id)
    body["key_proof"] = key_proof(stranger.key, body)
    detail = assert_problem(post(client, body), 401, "unauthenticated")["detail"]
    assert "revoked" not in detail and "key stolen" not in detail
    unchanged(host, before)

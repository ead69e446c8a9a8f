"""Enrolment (new and re-enrolment, what it admits) and agent credentials: the signing key, the
signed format, and every row of the spec's credential state table, with time moved by `clock_at`."""

import base64
import json
import os
from datetime import timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent import credential as agent_credential
from agent.credential import CredentialError, b64url_decode, b64url_encode, public_key_encode
from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from controlplane.models import GatewayIdentity
from controlplane.problems import Problem, ValidationFailed
from fleet import credentials
from fleet.credentials import (
    credential_issue,
    credential_renew,
    credential_renewal_due_at,
    credential_renewal_failed,
    credential_state,
    credential_verify,
    signing_public_key,
)
from fleet.enrolment import workload_enrol
from fleet.models import ProvisioningToken, Workload
from fleet.provisioning import provisioning_token_mint
from tests.support.workloads import make_workload

DAY = timedelta(days=1)


@pytest.fixture(autouse=True)
def data_dir(settings, tmp_path):
    settings.DATA_DIR = tmp_path
    return tmp_path


@pytest.fixture
def provisioning_secret(db):
    """A provisioning token's secret; its labels are app=web, env=prod."""
    GatewayIdentity.objects.create(
        id=1, address="gw.example.test:8443", fingerprint=":".join(["AA"] * 32), updated_at=clock.now()
    )
    return provisioning_token_mint(
        actor=CLI_ACTOR, data={"description": "tests", "labels": {"app": "web", "env": "prod"}}
    ).secret


def agent_key() -> str:
    return public_key_encode(Ed25519PrivateKey.generate().public_key())


def enrol(secret, **overrides):
    kwargs = dict(
        token_secret=secret,
        public_key=agent_key(),
        hostname="web-1.example.com",
        addresses=["10.0.0.5"],
        agent_version="0.1.0",
    )
    return workload_enrol(**{**kwargs, **overrides})


def fresh(workload) -> Workload:
    return Workload.objects.get(id=workload.id)


# --- enrolment ----------------------------------------------------------------------------------------


def test_enrolment_creates_a_visibility_workload_never_connected_with_the_tokens_labels(provisioning_secret):
    key = agent_key()
    enrolled = enrol(
        provisioning_secret,
        public_key=key,
        addresses=["10.0.0.5", "2001:DB8::1", " 10.0.0.5", "::ffff:10.0.0.6"],
    )
    workload = fresh(enrolled.workload)
    assert not enrolled.re_enrolled
    assert workload.mode == "visibility"
    assert workload.sync_state == "offline" and workload.last_heard_from is None
    assert workload.rank == Workload.RANK_OFFLINE
    assert workload.labels == {"app": "web", "env": "prod"}
    assert workload.hostname == "web-1.example.com" and workload.agent_version == "0.1.0"
    assert workload.addresses == ["10.0.0.5", "2001:db8::1", "10.0.0.6"]
    assert workload.public_key == key
    assert workload.enrolled_with == ProvisioningToken.objects.get()
    assert workload.enrolled_at == workload.credential_issued_at
    assert workload.latest_policy_id  # its document is rendered at enrolment
    assert workload.credential_serial == 1 and enrolled.credential.serial == 1
    assert workload.credential_expires_at - workload.credential_issued_at == timedelta(days=30)
    assert credential_state(workload) == "renews"


def test_enrolment_renders_the_documents_of_workloads_that_take_it_as_a_peer(api, provisioning_secret):
    database = make_workload(hostname="db-1", labels={"role": "db"}, mode="enforced")
    ruleset = api.post(
        "/api/v1/rulesets",
        {
            "name": "db",
            "scope": "role=db",
            "rules": [
                {"sources": [{"selector": "app=web"}], "services": [{"protocol": "tcp", "port": 5432}]}
            ],
        },
        format="json",
    )
    assert ruleset.status_code == 201, ruleset.content
    before = fresh(database).latest_policy_id
    enrol(provisioning_secret, addresses=["10.77.0.9"])
    after = fresh(database)
    assert after.latest_policy_id != before
    assert "10.77.0.9" in after.latest_policy.document


def test_re_enrolment_keeps_id_labels_and_mode_and_replaces_key_and_credential(provisioning_secret, clock_at):
    first = enrol(provisioning_secret).workload
    Workload.objects.filter(id=first.id).update(
        mode="enforced",
        labels={"app": "web", "tier": "1"},
        labels_version=4,
        credential_renewal_failed=True,
        credential_last_error="timeout",
    )
    other_token = provisioning_token_mint(
        actor=CLI_ACTOR, data={"description": "rebuild", "workload_id": str(first.id)}
    )
    clock_at(10 * DAY)
    new_key = agent_key()
    again = enrol(
        other_token.secret,
        workload_id=str(first.id),
        public_key=new_key,
        hostname="web-1-rebuilt",
        addresses=["10.0.0.7"],
        agent_version="0.2.0",
    )
    workload = fresh(again.workload)
    assert again.re_enrolled and workload.id == first.id
    assert workload.mode == "enforced"
    assert workload.labels == {"app": "web", "tier": "1"} and workload.labels_version == 4
    assert workload.public_key == new_key != first.public_key
    assert (workload.hostname, workload.addresses, workload.agent_version) == (
        "web-1-rebuilt",
        ["10.0.0.7"],
        "0.2.0",
    )
    assert workload.credential_serial == 2 and again.credential.serial == 2
    assert workload.credential_issued_at > first.credential_issued_at
    assert not workload.credential_renewal_failed and workload.credential_last_error == ""
    assert workload.enrolled_with_id == other_token.token.id
    assert Workload.objects.count() == 1
    assert credential_verify(again.credential.text)["public_key"] == new_key


def test_re_enrolling_an_unknown_workload_is_not_found_and_uses_nothing(provisioning_secret):
    for workload_id in ("00000000-0000-0000-0000-000000000000", "nope"):
        with pytest.raises(Problem) as missing:
            enrol(provisioning_secret, workload_id=workload_id)
        assert missing.value.name == "not-found"
    assert ProvisioningToken.objects.get().uses == 0
    assert not Workload.objects.exists()


def findings_of(error: ValidationFailed) -> list[tuple[str, str]]:
    return sorted((f.path, f.rule) for f in error.findings)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"public_key": "nope"}, [("/public_key", "public-key")]),
        ({"public_key": base64.b64encode(b"x" * 31).decode()}, [("/public_key", "public-key")]),
        ({"public_key": base64.urlsafe_b64encode(b"\xfb" * 32).decode()}, [("/public_key", "public-key")]),
        ({"public_key": None}, [("/public_key", "public-key")]),
        ({"hostname": ""}, [("/hostname", "too-short")]),
        ({"hostname": "a" * 256}, [("/hostname", "too-long")]),
        ({"hostname": "bad host!"}, [("/hostname", "hostname")]),
        ({"hostname": "-lead.example"}, [("/hostname", "hostname")]),
        ({"hostname": "a..b"}, [("/hostname", "hostname")]),
        ({"hostname": 7}, [("/hostname", "type")]),
        ({"addresses": "10.0.0.1"}, [("/addresses", "type")]),
        ({"addresses": [f"10.0.1.{n}" for n in range(65)]}, [("/addresses", "too-many")]),
        (
            {"addresses": ["10.0.0.1", "10.0.0.0/24", "nope", 5, "fe80::1%eth0"]},
            [
                ("/addresses/1", "address"),
                ("/addresses/2", "address"),
                ("/addresses/3", "type"),
                ("/addresses/4", "address"),
            ],
        ),
        ({"agent_version": "v" * 65}, [("/agent_version", "too-long")]),
        (
            {"public_key": "", "hostname": "", "addresses": ["x"]},
            [("/addresses/0", "address"), ("/hostname", "too-short"), ("/public_key", "public-key")],
        ),
    ],
)
def test_enrolment_findings(provisioning_secret, overrides, expected):
    with pytest.raises(ValidationFailed) as refused:
        enrol(provisioning_secret, **overrides)
    assert findings_of(refused.value) == expected
    assert all(f.message for f in refused.value.findings)
    assert not Workload.objects.exists()
    assert ProvisioningToken.objects.get().uses == 0


def test_a_trailing_dot_and_an_empty_address_list_are_admitted(provisioning_secret):
    workload = enrol(provisioning_secret, hostname="db.example.com.", addresses=[]).workload
    assert (workload.hostname, workload.addresses) == ("db.example.com", [])


def test_the_token_is_checked_before_the_input(db):
    with pytest.raises(Problem) as refused:
        enrol("pal_pt_unknown", hostname="")
    assert refused.value.name == "unauthenticated"


# --- the signing key and the credential format ----------------------------------------------------------


def test_signing_key_is_private_made_once_and_reused(data_dir, db):
    path = data_dir / "agent-signing-key.pem"
    assert not path.exists()
    public = signing_public_key()
    assert path.stat().st_mode & 0o777 == 0o600
    content = path.read_bytes()
    assert b"PRIVATE KEY" in content
    credentials._key_cache.clear()  # as a new process would
    assert signing_public_key() == public
    assert path.read_bytes() == content
    assert len(base64.b64decode(public)) == 32
    assert not [p for p in os.listdir(data_dir) if p.endswith(".tmp")]


def test_credential_is_signed_and_verifies(provisioning_secret):
    enrolled = enrol(provisioning_secret)
    workload = fresh(enrolled.workload)
    text = enrolled.credential.text
    outer = json.loads(text)
    assert set(outer) == {"payload", "signature"}
    payload = credential_verify(text)
    assert payload == {
        "v": 1,
        "workload_id": str(workload.id),
        "public_key": workload.public_key,
        "serial": 1,
        "issued_at": clock.rfc3339(workload.credential_issued_at),
        "expires_at": clock.rfc3339(workload.credential_expires_at),
    }
    # the agent checks it with the public key alone, without Django
    assert agent_credential.credential_verify(text, signing_public_key()) == payload
    assert (
        credential_issue(workload=workload).text == text
    )  # Ed25519 is deterministic: the row is the credential


def test_a_credential_verified_before_is_refused_once_the_signing_key_is_replaced(
    data_dir, provisioning_secret
):
    text = enrol(provisioning_secret).credential.text
    assert credential_verify(text)["serial"] == 1
    (data_dir / "agent-signing-key.pem").unlink()  # an operator forcing every workload to re-enrol
    with pytest.raises(Problem) as refused:
        credential_verify(text)
    assert refused.value.name == "unauthenticated"


def _tampered_payload(text: str, **changes) -> str:
    outer = json.loads(text)
    payload = json.loads(b64url_decode(outer["payload"], "payload"))
    payload.update(changes)
    outer["payload"] = b64url_encode(json.dumps(payload, separators=(",", ":")).encode())
    return json.dumps(outer)


def test_a_tampered_or_foreign_credential_does_not_verify(provisioning_secret):
    text = enrol(provisioning_secret).credential.text
    outer = json.loads(text)
    signature = bytearray(b64url_decode(outer["signature"], "signature"))
    signature[0] ^= 1
    foreign_key = Ed25519PrivateKey.generate()
    payload = agent_credential.credential_parse(text)
    forged = [
        _tampered_payload(text, serial=2),
        _tampered_payload(text, expires_at="2999-01-01T00:00:00.000000Z"),
        json.dumps({**outer, "signature": b64url_encode(bytes(signature))}),
        agent_credential.credential_sign(payload, foreign_key),
    ]
    for bad in forged:
        with pytest.raises(Problem) as refused:
            credential_verify(bad)
        assert refused.value.name == "unauthenticated" and "does not verify" in refused.value.detail
        with pytest.raises(CredentialError):
            agent_credential.credential_verify(bad, signing_public_key())


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[]",
        '{"payload": "x"}',
        '{"payload": "@@", "signature": "AA"}',
        '{"payload": "", "signature": ""}',
    ],
)
def test_malformed_credentials_are_refused(db, text):
    with pytest.raises(Problem) as refused:
        credential_verify(text)
    assert refused.value.name == "unauthenticated"


# --- the credential state table -------------------------------------------------------------------------


@pytest.fixture
def workload(provisioning_secret):
    return fresh(enrol(provisioning_secret).workload)


def test_renews_while_valid_and_renewal_is_due_at_two_thirds(workload, clock_at):
    assert credential_state(workload) == "renews"
    assert credential_renewal_due_at(workload) == workload.credential_issued_at + timedelta(days=20)
    clock_at(29 * DAY)
    assert credential_state(workload) == "renews"


def test_renews_to_renewal_failed_on_a_failed_attempt(workload, clock_at):
    clock_at(21 * DAY)
    credential_renewal_failed(workload_id=str(workload.id), error="gateway unreachable: connection refused")
    workload = fresh(workload)
    assert credential_state(workload) == "renewal-failed"
    assert workload.credential_last_error == "gateway unreachable: connection refused"


def test_renewal_failed_to_renews_on_success(workload, clock_at):
    clock_at(21 * DAY)
    credential_renewal_failed(workload_id=str(workload.id), error="timeout")
    clock_at(DAY)
    renewed = credential_renew(workload_id=str(workload.id))
    after = fresh(workload)
    assert credential_state(after) == "renews"
    assert not after.credential_renewal_failed and after.credential_last_error == ""
    assert after.credential_last_late_renewal is None  # it was still valid
    assert renewed.serial == after.credential_serial == 2
    assert after.credential_issued_at == renewed.issued_at > workload.credential_issued_at
    assert after.credential_expires_at == after.credential_issued_at + timedelta(days=30)
    assert credential_verify(renewed.text)["serial"] == 2


@pytest.mark.parametrize("failed_first", [False, True])
def test_passing_of_expiry_makes_it_expired(workload, clock_at, failed_first):
    if failed_first:
        credential_renewal_failed(workload_id=str(workload.id), error="e")
    workload = fresh(workload)
    clock_at(30 * DAY - timedelta(seconds=1))
    assert credential_state(workload) == ("renewal-failed" if failed_first else "renews")
    clock_at(timedelta(seconds=1))  # exactly the expiry
    assert credential_state(workload) == "expired"


def test_expired_within_the_grace_renews_and_records_the_late_renewal(workload, clock_at):
    clock_at(30 * DAY + timedelta(hours=71))
    assert credential_state(fresh(workload)) == "expired"
    renewed = credential_renew(workload_id=str(workload.id))
    after = fresh(workload)
    assert credential_state(after) == "renews"
    assert after.credential_last_late_renewal >= workload.credential_expires_at + timedelta(hours=71)
    assert after.credential_last_late_renewal == after.credential_issued_at == renewed.issued_at
    assert after.last_heard_from == after.credential_last_late_renewal  # the renewal was contact
    late_by = after.credential_last_late_renewal - workload.credential_expires_at
    assert after.credential_last_late_by_seconds == int(late_by.total_seconds())
    assert renewed.serial == 2


def test_expired_beyond_the_grace_is_refused_until_re_enrolled(workload, clock_at):
    clock_at(30 * DAY + timedelta(hours=72))  # the grace is over at this instant
    with pytest.raises(Problem) as refused:
        credential_renew(workload_id=str(workload.id))
    assert refused.value.name == "unauthenticated" and "re-enrol" in refused.value.detail
    after = fresh(workload)
    assert credential_state(after) == "expired" and after.credential_serial == 1
    secret = provisioning_token_mint(
        actor=CLI_ACTOR, data={"description": "re-enrol", "workload_id": str(workload.id)}
    ).secret
    enrol(secret, workload_id=str(workload.id))
    assert credential_state(fresh(workload)) == "renews"


def test_lifetime_and_grace_come_from_settings(provisioning_secret, settings, clock_at):
    settings.PALISADE_CREDENTIAL_LIFETIME_SECONDS = 3600
    settings.PALISADE_CREDENTIAL_GRACE_SECONDS = 600
    workload = fresh(enrol(provisioning_secret).workload)
    assert workload.credential_expires_at - workload.credential_issued_at == timedelta(hours=1)
    assert credential_renewal_due_at(workload) == workload.credential_issued_at + timedelta(minutes=40)
    clock_at(timedelta(hours=1, minutes=9))
    credential_renew(workload_id=str(workload.id))  # within the ten-minute grace
    clock_at(timedelta(hours=1, minutes=10))
    with pytest.raises(Problem, match="re-enrol"):
        credential_renew(workload_id=str(workload.id))


def test_renewing_an_unknown_workload_is_not_found(db):
    with pytest.raises(Problem) as missing:
        credential_renew(workload_id="00000000-0000-0000-0000-000000000000")
    assert missing.value.name == "not-found"
    with pytest.raises(Problem) as missing:
        credential_renewal_failed(workload_id="nope", error="x")
    assert missing.value.name == "not-found"

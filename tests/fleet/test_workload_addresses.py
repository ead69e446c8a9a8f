"""The addresses a workload may hold, as a hostile enrolled host tries them at POST /agent/v1/enrol:
addresses that name no one host (unspecified, loopback, link-local, multicast, broadcast, in any
spelling) are refused with a finding, at enrolment and at a key-signed re-enrolment (the agent renewing
its key); an address another active workload holds is refused with a problem naming that workload,
until it is revoked or re-enrolled without it. Every refusal changes nothing."""

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.db import connection

from agent import protocol
from agent.credential import format_instant, public_key_encode
from controlplane import clock, runtime
from controlplane.auth.actor import CLI_ACTOR
from controlplane.problems import Problem
from fleet.credentials import credential_revoke
from fleet.enrolment import workload_enrol
from fleet.models import ProvisioningToken, Workload
from fleet.provisioning import provisioning_token_mint
from tests.support.helpers import assert_problem, race
from tests.support.requirements import require

FINGERPRINT = ":".join(["CD"] * 32)
pytestmark = pytest.mark.urls("controlplane.urls_gateway")


@pytest.fixture(autouse=True)
def gateway(settings, tmp_path):
    settings.DATA_DIR = tmp_path
    runtime.facts_set(gateway_fingerprint=FINGERPRINT, gateway_advertise=("gw.example.test:8443",))


def mint(**data) -> str:
    return provisioning_token_mint(actor=CLI_ACTOR, data={"description": "t", **data}).secret


class Host:
    """An agent host with its key; `enrol` and `rotate` post to the gateway as its agent would."""

    def __init__(self, client, hostname: str):
        self.client, self.hostname = client, hostname
        self.key = Ed25519PrivateKey.generate()
        self.workload_id: str | None = None

    def body(self, addresses, *, token: str = "", key=None) -> dict:
        body = {
            "v": 1,
            "token": token,
            "public_key": public_key_encode((key or self.key).public_key()),
            "hostname": self.hostname,
            "addresses": list(addresses),
            "agent_version": "0.1.0",
        }
        if self.workload_id is not None:
            body["workload_id"] = self.workload_id
        return body

    def enrol(self, *addresses: str, token: str | None = None):
        response = self.post(self.body(addresses, token=token or mint()))
        if response.status_code == 201:
            self.workload_id = response.json()["workload_id"]
        return response

    def rotate(self, *addresses: str):
        """Re-enrol with a new key, signed with the current one (`palisade-agent enrol --reenrol`)."""
        new_key = Ed25519PrivateKey.generate()
        body = self.body(addresses, key=new_key)
        body["key_proof"] = protocol.sign_key_proof(
            self.key,
            workload_id=self.workload_id,
            serial=self.row().credential_serial,
            public_key=body["public_key"],
            hostname=body["hostname"],
            addresses=body["addresses"],
            signed_at=format_instant(clock.now()),
            gateway_fingerprint=FINGERPRINT,
        )
        response = self.post(body)
        if response.status_code == 201:
            self.key = new_key
        return response

    def post(self, body):
        return self.client.post(protocol.ENROL_PATH, body, content_type="application/json")

    def row(self) -> Workload:
        return Workload.objects.get(id=self.workload_id)


REFUSED = [
    ("0.0.0.0", "address-unspecified"),  # noqa: S104 - an address refused, not a bind
    ("0.1.2.3", "address-unspecified"),  # 0.0.0.0/8, "this network"
    ("::", "address-unspecified"),
    ("::ffff:0.0.0.0", "address-unspecified"),
    ("127.0.0.1", "address-loopback"),
    ("127.8.9.10", "address-loopback"),
    ("::1", "address-loopback"),
    ("::ffff:127.0.0.1", "address-loopback"),
    ("0:0:0:0:0:0:0:1", "address-loopback"),
    ("169.254.169.254", "address-link-local"),
    ("fe80::1", "address-link-local"),
    ("FE80::a9fe:a9fe", "address-link-local"),
    ("224.0.0.1", "address-multicast"),
    ("239.255.255.250", "address-multicast"),
    ("ff02::1", "address-multicast"),
    ("::ffff:224.0.0.251", "address-multicast"),
    ("255.255.255.255", "address-broadcast"),
]


@pytest.mark.parametrize("address, rule", REFUSED, ids=[a for a, _ in REFUSED])
def test_an_address_of_no_one_host_is_refused_at_enrolment_with_a_finding(client, db, address, rule):
    token = mint(max_uses=1)
    response = Host(client, "web-1").enrol("10.1.0.1", address, token=token)
    assert_problem(response, 422, "validation")
    (finding,) = response.json()["errors"]
    assert (finding["path"], finding["rule"]) == ("/addresses/1", rule)
    kind = rule.removeprefix("address-")
    assert f"is {'an' if kind == 'unspecified' else 'a'} {kind} address: it names" in finding["message"]
    assert not Workload.objects.exists() and ProvisioningToken.objects.get().uses == 0


@pytest.mark.parametrize("address, rule", REFUSED[::4], ids=[a for a, _ in REFUSED[::4]])
def test_an_address_of_no_one_host_is_refused_at_a_key_signed_re_enrolment(client, db, address, rule):
    host = Host(client, "web-1")
    assert host.enrol("10.1.0.1").status_code == 201
    before = host.row()
    response = host.rotate("10.1.0.1", address)
    assert_problem(response, 422, "validation")
    assert [(e["path"], e["rule"]) for e in response.json()["errors"]] == [("/addresses/1", rule)]
    after = host.row()
    assert (after.addresses, after.public_key, after.credential_serial) == (
        ["10.1.0.1"],
        before.public_key,
        before.credential_serial,
    )


def test_an_address_another_active_workload_holds_is_refused_naming_it(client, db):
    holder = Host(client, "db-1")
    assert holder.enrol("10.1.0.7", "2001:db8::7").status_code == 201
    token = mint(max_uses=1)
    # Spelled another way: the address as stored is what counts.
    response = Host(client, "intruder").enrol("10.1.0.8", "::ffff:10.1.0.7", "2001:DB8::7", token=token)
    assert_problem(response, 409, "address-taken")
    problem = response.json()
    assert f"workload {holder.workload_id} (db-1)" in problem["detail"]
    assert sorted(problem["held_by"], key=lambda h: h["address"]) == [
        {"address": "10.1.0.7", "workload_id": holder.workload_id, "hostname": "db-1"},
        {"address": "2001:db8::7", "workload_id": holder.workload_id, "hostname": "db-1"},
    ]
    assert Workload.objects.count() == 1 and ProvisioningToken.objects.get(prefix=token[:12]).uses == 0


def test_a_re_enrolment_that_adds_an_address_another_workload_holds_is_refused(client, db):
    holder, other = Host(client, "db-1"), Host(client, "web-1")
    assert holder.enrol("10.1.0.7").status_code == 201
    assert other.enrol("10.1.0.9").status_code == 201
    response = other.rotate("10.1.0.9", "10.1.0.7")
    assert_problem(response, 409, "address-taken")
    assert response.json()["held_by"] == [
        {"address": "10.1.0.7", "workload_id": holder.workload_id, "hostname": "db-1"}
    ]
    assert other.row().addresses == ["10.1.0.9"]
    # Its own addresses are its own: keeping them re-enrols.
    assert other.rotate("10.1.0.9").status_code == 201


def test_an_address_is_freed_when_its_workload_is_revoked(client, db):
    holder = Host(client, "db-1")
    assert holder.enrol("10.1.0.7").status_code == 201
    assert Host(client, "next").enrol("10.1.0.7").status_code == 409
    credential_revoke(actor=CLI_ACTOR, workload_id=holder.workload_id)
    successor = Host(client, "db-1-rebuilt")
    assert successor.enrol("10.1.0.7").status_code == 201
    # The revoked workload, brought back by its operator, finds its old address taken.
    back = holder.enrol("10.1.0.7", token=mint(workload_id=holder.workload_id))
    assert_problem(back, 409, "address-taken")
    assert successor.workload_id in back.json()["detail"]


def test_an_address_is_freed_when_its_workload_re_enrols_without_it(client, db):
    holder = Host(client, "db-1")
    assert holder.enrol("10.1.0.7", "10.1.0.70").status_code == 201
    assert holder.rotate("10.1.0.70").status_code == 201  # drops 10.1.0.7
    assert holder.row().addresses == ["10.1.0.70"]
    assert Host(client, "web-1").enrol("10.1.0.7").status_code == 201
    assert Host(client, "web-2").enrol("10.1.0.70").status_code == 409


@pytest.mark.postgres
def test_two_enrolments_racing_for_one_address_enrol_one_workload(transactional_db):
    require(connection.vendor == "postgresql", "concurrent transactions: PostgreSQL (DATABASE_URL)")
    for attempt in range(5):
        token = mint(max_uses=3)

        def enrol(n, attempt=attempt, token=token):
            return workload_enrol(
                token_secret=token,
                public_key=public_key_encode(Ed25519PrivateKey.generate().public_key()),
                hostname=f"race-{attempt}-{n}",
                addresses=[f"10.2.{attempt}.{n}", f"10.3.{attempt}.1"],
                agent_version="0.1.0",
            )

        results = race(*[lambda n=n: enrol(n) for n in range(3)])
        enrolled = [r for r in results if not isinstance(r, Exception)]
        refused = [r for r in results if isinstance(r, Exception)]
        assert len(enrolled) == 1, results
        assert all(isinstance(r, Problem) and r.name == "address-taken" for r in refused), refused
        holders = [w for w in Workload.objects.all() if f"10.3.{attempt}.1" in w.addresses]
        assert len(holders) == 1

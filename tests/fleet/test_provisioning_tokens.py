"""Provisioning tokens: mint (API and host command, same findings), list, revoke, the enrolment
bundle, and consumption: uses, expiry, revocation and max_uses, also under concurrent enrolments."""

import base64
import hashlib
import ipaddress
import itertools
import json
from datetime import timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.db import connection

from agent.bundle import BUNDLE_PREFIX, BUNDLE_PREFIX_V2, BundleError, bundle_decode, bundle_encode
from agent.credential import public_key_encode
from controlplane import clock, tls
from controlplane.auth.actor import CLI_ACTOR
from controlplane.models import GatewayIdentity
from controlplane.problems import Problem, ValidationFailed
from fleet.enrolment import workload_enrol
from fleet.models import ProvisioningToken, Workload
from fleet.provisioning import provisioning_token_consume, provisioning_token_mint, provisioning_token_revoke
from tests.support.helpers import assert_problem, race
from tests.support.helpers import run_command as run
from tests.support.requirements import require

FINGERPRINT = ":".join(f"{i:02X}" for i in range(32))
GATEWAY = "gateway.example.test:8443"


@pytest.fixture(autouse=True)
def data_dir(settings, tmp_path):
    settings.DATA_DIR = tmp_path
    return tmp_path


@pytest.fixture
def gateway(db):
    return GatewayIdentity.objects.create(
        id=1, address=GATEWAY, fingerprint=FINGERPRINT, updated_at=clock.now()
    )


def mint(**data):
    return provisioning_token_mint(actor=CLI_ACTOR, data={"description": "test", **data})


def agent_public_key() -> str:
    return public_key_encode(Ed25519PrivateKey.generate().public_key())


_hosts = itertools.count(1)


def enrol(secret, **overrides):
    kwargs = dict(
        token_secret=secret,
        public_key=agent_public_key(),
        hostname="web-1",
        addresses=[str(ipaddress.IPv4Address("10.0.0.4") + next(_hosts))],  # one workload holds an address
        agent_version="0.1.0",
    )
    return workload_enrol(**{**kwargs, **overrides})


RECORD_FIELDS = {
    "id",
    "description",
    "prefix",
    "labels",
    "workload_id",
    "created_at",
    "expires_at",
    "max_uses",
    "uses",
    "last_used_at",
    "revoked_at",
    "state",
}


# --- mint, list, revoke over the API -----------------------------------------------------------------


def test_mint_shows_the_token_and_bundle_once_and_stores_only_a_digest(api, gateway):
    response = api.post(
        "/api/v1/provisioning-tokens",
        {"description": "web tier", "max_uses": 3, "labels": {"app": "web", "example.com/env": "prod"}},
        format="json",
    )
    assert response.status_code == 201, response.content
    body = response.json()
    secret = body["token"]
    assert secret.startswith("pal_pt_") and len(secret) > 40
    assert bundle_decode(body["bundle"]) == {
        "gateways": [GATEWAY],
        "gateway": GATEWAY,
        "fingerprint": FINGERPRINT,
        "token": secret,
    }
    record = body["record"]
    assert set(record) == RECORD_FIELDS
    assert record["prefix"] == secret[:12]
    assert record["labels"] == {"app": "web", "example.com/env": "prod"}
    assert (record["max_uses"], record["uses"], record["state"]) == (3, 0, "active")
    assert record["expires_at"] is record["last_used_at"] is record["revoked_at"] is None

    stored = ProvisioningToken.objects.get(id=record["id"])
    assert stored.digest == hashlib.sha256(secret.encode()).hexdigest()
    listed = api.get("/api/v1/provisioning-tokens").json()
    assert listed["items"] == [record] and listed["next_cursor"] is None
    assert secret not in json.dumps(listed) and stored.digest not in json.dumps(listed)


def test_bundle_before_serve_ever_started_uses_the_gateway_certificate_serve_will_use(
    api, settings, data_dir
):
    settings.PALISADE_GATEWAY_ADVERTISE = "cp.example.test:9443"
    body = api.post("/api/v1/provisioning-tokens", {"description": "first"}, format="json").json()
    fields = bundle_decode(body["bundle"])
    assert fields["gateway"] == "cp.example.test:9443"
    assert fields["fingerprint"] == tls.fingerprint_of((data_dir / "gateway-cert.pem").read_bytes())
    # serve later loads the same certificate, so the fingerprint the agent pins stays right
    assert tls.ensure_certificate(data_dir, "gateway", []).fingerprint == fields["fingerprint"]


def test_list_pages_in_creation_order(api, gateway, clock_at):
    ids = []
    for n in range(5):
        ids.append(str(mint(description=f"t{n}").token.id))
        clock_at(timedelta(seconds=1))
    seen, cursor = [], None
    while True:
        body = api.get("/api/v1/provisioning-tokens?limit=2" + (f"&cursor={cursor}" if cursor else "")).json()
        seen += [t["id"] for t in body["items"]]
        if not (cursor := body["next_cursor"]):
            break
    assert seen == ids
    forged = assert_problem(api.get("/api/v1/provisioning-tokens?cursor=forged"), 422, "validation")
    assert forged["errors"][0]["rule"] == "cursor-invalid"


def test_revoke_is_idempotent_and_the_token_enrols_nothing_after(api, gateway):
    minted = mint()
    response = api.delete(f"/api/v1/provisioning-tokens/{minted.token.id}")
    assert response.status_code == 200
    record = response.json()
    assert record["revoked_at"] and record["state"] == "revoked"
    assert (
        api.delete(f"/api/v1/provisioning-tokens/{minted.token.id}").json()["revoked_at"]
        == record["revoked_at"]
    )
    with pytest.raises(Problem) as refused:
        enrol(minted.secret)
    assert refused.value.name == "unauthenticated" and "revoked" in refused.value.detail
    assert not Workload.objects.exists()


def test_revoke_unknown_token_is_not_found(api):
    assert_problem(
        api.delete("/api/v1/provisioning-tokens/00000000-0000-0000-0000-000000000000"), 404, "not-found"
    )
    assert_problem(api.delete("/api/v1/provisioning-tokens/not-a-uuid"), 404, "not-found")
    with pytest.raises(Problem) as missing:
        provisioning_token_revoke(actor=CLI_ACTOR, token_id="not-a-uuid")
    assert missing.value.name == "not-found"


def test_minting_requires_authentication(anon):
    assert_problem(anon.get("/api/v1/provisioning-tokens"), 401, "unauthenticated")
    assert_problem(
        anon.post("/api/v1/provisioning-tokens", {"description": "x"}, format="json"), 401, "unauthenticated"
    )


# --- what minting admits: the same findings on the API and the command line ----------------------------


def test_mint_findings(api, gateway):
    body = assert_problem(
        api.post(
            "/api/v1/provisioning-tokens",
            {
                "description": "",
                "expires_at": "tomorrow",
                "max_uses": 0,
                "labels": {"bad key!": "x", "ok": "bad value!"},
                "scope": "x",
            },
            format="json",
        ),
        422,
        "validation",
    )
    assert sorted((e["path"], e["rule"]) for e in body["errors"]) == [
        ("/description", "too-short"),
        ("/expires_at", "instant"),
        ("/labels/bad key!", "label-key"),
        ("/labels/ok", "label-value"),
        ("/max_uses", "out-of-range"),
        ("/scope", "unknown-field"),
    ]
    body = assert_problem(
        api.post(
            "/api/v1/provisioning-tokens",
            {
                "description": "   ",
                "expires_at": "2001-01-01T00:00:00Z",
                "max_uses": "3",
                "labels": ["app=web"],
            },
            format="json",
        ),
        422,
        "validation",
    )
    assert sorted((e["path"], e["rule"]) for e in body["errors"]) == [
        ("/description", "too-short"),
        ("/expires_at", "in-the-past"),
        ("/labels", "labels-type"),
        ("/max_uses", "type"),
    ]
    body = assert_problem(api.post("/api/v1/provisioning-tokens", {}, format="json"), 422, "validation")
    assert [(e["path"], e["rule"]) for e in body["errors"]] == [("/description", "required")]
    too_many = {f"k{n}": "v" for n in range(65)}
    body = assert_problem(
        api.post(
            "/api/v1/provisioning-tokens", {"description": "x" * 1001, "labels": too_many}, format="json"
        ),
        422,
        "validation",
    )
    assert sorted((e["path"], e["rule"]) for e in body["errors"]) == [
        ("/description", "too-long"),
        ("/labels", "too-many"),
    ]
    assert not ProvisioningToken.objects.exists()


@pytest.mark.parametrize(
    "args, body",
    [
        (
            ["--description", "", "--max-uses", "0", "--label", "bad key!=x", "--label", "ok=bad value!"],
            {"description": "", "max_uses": 0, "labels": {"bad key!": "x", "ok": "bad value!"}},
        ),
        (
            ["--description", "x", "--expires-at", "2001-01-01T00:00:00Z", "--label", "a/b/c="],
            {"description": "x", "expires_at": "2001-01-01T00:00:00Z", "labels": {"a/b/c": ""}},
        ),
        (["--description", "x", "--expires-at", "soon"], {"description": "x", "expires_at": "soon"}),
    ],
)
def test_cli_and_api_give_the_same_findings(api, gateway, args, body):
    api_problem = assert_problem(
        api.post("/api/v1/provisioning-tokens", body, format="json"), 422, "validation"
    )
    code, out, _ = run("provisioning-token", "mint", *args, "--json")
    assert code == 2
    assert json.loads(out)["errors"] == api_problem["errors"]
    code, _, err = run("provisioning-token", "mint", *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == len(api_problem["errors"]) and all(line.startswith("error: ") for line in lines)
    assert not ProvisioningToken.objects.exists()


def test_cli_mint_list_revoke(api, gateway):
    code, out, _ = run(
        "provisioning-token",
        "mint",
        "--description",
        "db hosts",
        "--max-uses",
        "2",
        "--label",
        "role=db",
        "--json",
    )
    assert code == 0
    minted = json.loads(out)
    assert bundle_decode(minted["bundle"])["token"] == minted["token"]
    assert minted["record"]["labels"] == {"role": "db"} and minted["record"]["max_uses"] == 2
    assert api.get("/api/v1/provisioning-tokens").json()["items"] == [minted["record"]]

    code, out, _ = run("provisioning-token", "mint", "--description", "plain")
    assert code == 0 and out.startswith(BUNDLE_PREFIX) and "shown only this once" in out

    code, out, _ = run("provisioning-token", "list", "--json")
    assert code == 0 and [t["description"] for t in json.loads(out)["items"]] == ["db hosts", "plain"]
    code, out, _ = run("provisioning-token", "list")
    assert code == 0 and "db hosts" in out and "0/2" in out and "pal_pt_" in out

    code, out, _ = run("provisioning-token", "revoke", minted["record"]["id"], "--json")
    assert code == 0 and json.loads(out)["state"] == "revoked"
    code, _, err = run("provisioning-token", "revoke", "nope")
    assert code == 1 and "not-found" in err and len(err.strip().splitlines()) == 1


def test_a_token_minted_for_a_workload_has_one_use_no_labels_and_shows_its_workload(api, gateway):
    workload = enrol(mint().secret).workload
    response = api.post(
        "/api/v1/provisioning-tokens",
        {"description": "rebuild web-1", "workload_id": str(workload.id)},
        format="json",
    )
    assert response.status_code == 201, response.content
    record = response.json()["record"]
    assert record["workload_id"] == str(workload.id) and record["max_uses"] == 1 and record["labels"] == {}
    listed = {t["id"]: t for t in api.get("/api/v1/provisioning-tokens").json()["items"]}
    assert listed[record["id"]]["workload_id"] == str(workload.id)
    assert [t["workload_id"] for t in listed.values() if t["id"] != record["id"]] == [None]
    code, out, _ = run("provisioning-token", "list")
    assert code == 0 and str(workload.id) in out and "(any new)" in out
    code, out, _ = run(
        "provisioning-token", "mint", "--description", "cli", "--workload-id", str(workload.id), "--json"
    )
    assert code == 0 and json.loads(out)["record"]["workload_id"] == str(workload.id)


@pytest.mark.parametrize(
    "extra, path",
    [
        ({"max_uses": 2}, "/max_uses"),
        ({"labels": {"app": "web"}}, "/labels"),
        ({"workload_id": "00000000-0000-0000-0000-000000000000"}, "/workload_id"),
        ({"workload_id": "nope"}, "/workload_id"),
        ({"workload_id": 7}, "/workload_id"),
    ],
)
def test_a_token_for_a_workload_is_checked_at_mint(api, gateway, extra, path):
    workload = enrol(mint().secret).workload
    body = {"description": "x", "workload_id": str(workload.id), **extra}
    problem = assert_problem(api.post("/api/v1/provisioning-tokens", body, format="json"), 422, "validation")
    assert path in [f["path"] for f in problem["errors"]]
    assert ProvisioningToken.objects.count() == 1


def test_cli_label_must_be_key_equals_value(db):
    code, _, err = run("provisioning-token", "mint", "--description", "x", "--label", "novalue")
    assert code == 1 and "KEY=VALUE" in err
    assert not ProvisioningToken.objects.exists()


# --- consumption: uses, expiry, max_uses --------------------------------------------------------------


def test_each_enrolment_uses_the_token_once_until_max_uses(gateway, clock_at):
    minted = mint(max_uses=2)
    enrol(minted.secret)
    clock_at(timedelta(minutes=5))
    enrol(minted.secret, hostname="web-2")
    token = ProvisioningToken.objects.get(id=minted.token.id)
    assert token.uses == 2 and token.last_used_at >= clock.now() - timedelta(seconds=5)
    with pytest.raises(Problem) as refused:
        enrol(minted.secret, hostname="web-3")
    assert refused.value.name == "unauthenticated"
    assert "used up" in refused.value.detail and "2 of 2" in refused.value.detail
    assert Workload.objects.count() == 2
    assert ProvisioningToken.objects.get(id=minted.token.id).uses == 2


def test_unlimited_token_counts_uses(gateway):
    minted = mint()
    for n in range(3):
        enrol(minted.secret, hostname=f"h{n}")
    assert ProvisioningToken.objects.get(id=minted.token.id).uses == 3


def test_expired_token_is_refused(gateway, clock_at):
    minted = mint(expires_at=clock.rfc3339(clock.now() + timedelta(hours=1)))
    provisioning_token_consume(secret=minted.secret)
    clock_at(timedelta(hours=1))
    with pytest.raises(Problem) as refused:
        provisioning_token_consume(secret=minted.secret)
    assert refused.value.name == "unauthenticated" and "expired" in refused.value.detail


@pytest.mark.parametrize("secret", ["pal_pt_unknown", "pal_op_something", "", "palisade-enrol-v1:abc"])
def test_unknown_secret_is_refused(db, secret):
    with pytest.raises(Problem) as refused:
        provisioning_token_consume(secret=secret)
    assert refused.value.name == "unauthenticated"


def test_a_refused_enrolment_gives_the_use_back(gateway):
    minted = mint(max_uses=1)
    with pytest.raises(ValidationFailed):
        enrol(minted.secret, hostname="not a host name")
    assert ProvisioningToken.objects.get(id=minted.token.id).uses == 0
    enrol(minted.secret)
    assert ProvisioningToken.objects.get(id=minted.token.id).uses == 1


# --- the bundle format --------------------------------------------------------------------------------


def test_bundle_round_trip_tolerates_pasting_whitespace():
    token = "pal_pt_" + "A" * 43
    bundle = bundle_encode(gateway="[2001:db8::1]:8443", fingerprint=FINGERPRINT.lower(), token=token)
    assert bundle.startswith(BUNDLE_PREFIX) and "=" not in bundle
    payload = json.loads(base64.urlsafe_b64decode(bundle[len(BUNDLE_PREFIX) :] + "=="))
    assert list(payload) == ["gateway", "fingerprint", "token"]
    wrapped = "  " + bundle[:30] + "\n  " + bundle[30:] + "\n"
    assert bundle_decode(wrapped) == {
        "gateways": ["[2001:db8::1]:8443"],
        "gateway": "[2001:db8::1]:8443",
        "fingerprint": FINGERPRINT,
        "token": token,
    }


def test_a_bundle_of_several_gateways_is_version_2_and_keeps_their_order():
    token = "pal_pt_" + "B" * 43
    gateways = ["gw-b.example.test:8443", "[2001:db8::1]:8443", "10.0.0.7:9443"]
    bundle = bundle_encode(gateways=gateways, fingerprint=FINGERPRINT, token=token)
    assert bundle.startswith(BUNDLE_PREFIX_V2)
    payload = json.loads(base64.urlsafe_b64decode(bundle[len(BUNDLE_PREFIX_V2) :] + "=="))
    assert list(payload) == ["gateways", "fingerprint", "token"]
    assert bundle_decode(bundle) == {
        "gateways": gateways,
        "gateway": gateways[0],
        "fingerprint": FINGERPRINT,
        "token": token,
    }
    # One gateway is still written as version 1, which agents of every version read.
    assert bundle_encode(gateways=gateways[:1], fingerprint=FINGERPRINT, token=token).startswith(
        BUNDLE_PREFIX
    )


def test_minted_bundles_list_every_gateway_serve_recorded(api, gateway):
    gateway.addresses = ["gw-a.example.test:8443", "gw-b.example.test:8443"]
    gateway.save()
    response = api.post("/api/v1/provisioning-tokens", {"description": "two"}, format="json")
    assert response.status_code == 201, response.content
    assert bundle_decode(response.json()["bundle"])["gateways"] == [
        "gw-a.example.test:8443",
        "gw-b.example.test:8443",
    ]


def _b64_v2(obj) -> str:
    return BUNDLE_PREFIX_V2 + base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()


GOOD_V2 = {"gateways": ["a.test:1", "b.test:2"], "fingerprint": FINGERPRINT, "token": "pal_pt_" + "A" * 43}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({**GOOD_V2, "gateways": []}, "non-empty list"),
        ({**GOOD_V2, "gateways": "a.test:1"}, "non-empty list"),
        ({**GOOD_V2, "gateways": ["a.test:1", "a.test:1"]}, "lists an address twice"),
        ({**GOOD_V2, "gateways": ["a.test:1", "no-port"]}, "is not HOST:PORT"),
        ({**GOOD_V2, "gateways": [f"h{i}.test:1" for i in range(17)]}, "at most 16"),
        ({"gateway": "a.test:1", "fingerprint": FINGERPRINT, "token": GOOD_V2["token"]}, "lacks gateways"),
    ],
)
def test_malformed_version_2_bundles_are_refused(fields, message):
    with pytest.raises(BundleError) as error:
        bundle_decode(_b64_v2(fields))
    assert message in str(error.value)


def _b64(obj) -> str:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return BUNDLE_PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


GOOD = {"gateway": GATEWAY, "fingerprint": FINGERPRINT, "token": "pal_pt_" + "A" * 43}


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "must be text"),
        ("", "empty"),
        ("   \n", "empty"),
        ("pal_pt_" + "A" * 43, "bare provisioning token"),
        ("palisade-enrol-v3:abc", "unsupported enrolment bundle version 'v3'"),
        ("hello", "must start with palisade-enrol-v1:"),
        (BUNDLE_PREFIX, "truncated"),
        (BUNDLE_PREFIX + "a+b/c", "not base64url"),
        (BUNDLE_PREFIX + "abcde", "not base64url"),
        (_b64(b"\xff\xfe"), "not JSON"),
        (_b64(b"not json"), "not JSON"),
        (_b64(GOOD)[:-10], "not JSON"),
        (_b64([1, 2]), "not a JSON object"),
        (_b64({"gateway": GATEWAY, "token": GOOD["token"]}), "lacks fingerprint"),
        (_b64({**GOOD, "extra": 1}), "unknown fields extra"),
        (_b64({**GOOD, "gateway": "no-port"}), "is not HOST:PORT"),
        (_b64({**GOOD, "gateway": "host:99999"}), "is not HOST:PORT"),
        (_b64({**GOOD, "gateway": "host:²"}), "is not HOST:PORT"),  # a digit to str.isdigit, not to int
        (_b64({**GOOD, "gateway": 8443}), "must be a string"),
        (_b64({**GOOD, "fingerprint": "AB:CD"}), "not a SHA-256 fingerprint"),
        (_b64({**GOOD, "token": "pal_op_" + "A" * 43}), "not a provisioning token"),
    ],
)
def test_malformed_bundles_are_refused_with_one_line(text, message):
    with pytest.raises(BundleError) as error:
        bundle_decode(text)
    assert message in str(error.value)
    assert "\n" not in str(error.value)
    assert isinstance(error.value, ValueError)


# --- concurrency: a single-use token enrols exactly one workload ---------------------------------------


@pytest.mark.postgres
def test_single_use_token_enrols_exactly_one_workload_under_concurrency(transactional_db):
    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    GatewayIdentity.objects.create(id=1, address=GATEWAY, fingerprint=FINGERPRINT, updated_at=clock.now())
    for attempt in range(5):
        minted = mint(max_uses=1)
        results = race(*[lambda n=n: enrol(minted.secret, hostname=f"race-{attempt}-{n}") for n in range(3)])
        enrolled = [r for r in results if not isinstance(r, Exception)]
        refused = [r for r in results if isinstance(r, Exception)]
        assert len(enrolled) == 1, results
        assert all(
            isinstance(r, Problem) and r.name == "unauthenticated" and "used up" in r.detail for r in refused
        )
        assert ProvisioningToken.objects.get(id=minted.token.id).uses == 1
        assert Workload.objects.filter(enrolled_with=minted.token.id).count() == 1

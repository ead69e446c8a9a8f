"""Enrolment against a stand-in gateway (tests/support/fake_gateway.py) speaking agent/protocol.py."""

from __future__ import annotations

import json
import os
import stat

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.credential import credential_parse, public_key_encode
from agent.enrol import _check_credential, enrol
from agent.errors import AgentError
from agent.protocol import EnrolResponse, verify_key_proof
from agent.state import StateDir
from tests.support.agent_helpers import GatewayThread, assert_one_line_error, run_cli


@pytest.fixture
def gateway(tmp_path):
    running = GatewayThread(tmp_path / "gateway")
    yield running
    running.close()


def test_enrol_stores_key_credential_and_identity(gateway, tmp_path):
    state_dir = tmp_path / "state"
    done = run_cli(
        "enrol", "--bundle", gateway.bundle(), "--state-dir", str(state_dir),
        "--hostname", "web-1", "--address", "10.0.0.5", "--address", "2001:db8::5",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("enrolled as workload ")
    state = StateDir(state_dir)
    identity = state.load_identity()
    assert stat.S_IMODE(os.stat(state_dir).st_mode) == 0o700
    for name in ("key.pem", "credential", "identity.json"):
        assert stat.S_IMODE(os.stat(state.file(name)).st_mode) == 0o600
    assert identity.fingerprint == gateway.gateway.fingerprint
    assert identity.gateway == gateway.gateway.address
    assert identity.signing_public_key == gateway.gateway.signing_public_key
    assert identity.certificate_pem.startswith("-----BEGIN CERTIFICATE-----")
    enrolled = gateway.gateway.workloads[identity.workload_id]
    assert enrolled == {
        "public_key": public_key_encode(state.load_key().public_key()),
        "hostname": "web-1",
        "addresses": ["10.0.0.5", "2001:db8::5"],
    }
    assert credential_parse(state.load_credential())["workload_id"] == identity.workload_id
    status = json.loads(run_cli("status", "--state-dir", str(state_dir), "--json").stdout)
    assert status["workload_id"] == identity.workload_id and status["daemon"]["running"] is None


def test_default_hostname_and_addresses(gateway, tmp_path):
    import socket

    identity = enrol(gateway.bundle(), str(tmp_path / "s"))
    enrolled = gateway.gateway.workloads[identity.workload_id]
    assert enrolled["hostname"] == socket.gethostname()
    assert all(not a.startswith(("127.", "fe80:")) and a != "::1" for a in enrolled["addresses"])


def test_used_up_token_shows_the_gateways_detail(gateway, tmp_path):
    bundle = gateway.bundle(uses=1)
    assert run_cli("enrol", "--bundle", bundle, "--state-dir", str(tmp_path / "a")).returncode == 0
    done = run_cli("enrol", "--bundle", bundle, "--state-dir", str(tmp_path / "b"))
    assert_one_line_error(
        done, "enrolment refused", "unknown, revoked, expired or used up", "401 unauthenticated"
    )
    assert not StateDir(tmp_path / "b").is_enrolled()


def test_already_enrolled_and_reenrol(gateway, tmp_path):
    state_dir = str(tmp_path / "s")
    first = enrol(gateway.bundle(), state_dir, hostname="h", addresses=[])
    first_key = public_key_encode(StateDir(state_dir).load_key().public_key())

    assert_one_line_error(
        run_cli("enrol", "--bundle", gateway.bundle(), "--state-dir", state_dir),
        "already enrolled",
        "--reenrol",
    )
    done = run_cli(
        "enrol", "--reenrol", "--bundle", gateway.bundle(), "--state-dir", state_dir, "--hostname", "h"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"re-enrolled as workload {first.workload_id}")
    second_key = public_key_encode(StateDir(state_dir).load_key().public_key())
    assert second_key != first_key
    assert gateway.gateway.workloads[first.workload_id]["public_key"] == second_key


def test_reenrol_signs_with_the_current_key_and_needs_no_bundle_then(gateway, tmp_path):
    """The agent rotating its own key: the request carries a proof by the key it is enrolled with,
    bound to the new key, host name, addresses, the current credential's serial and the gateway."""
    state_dir = str(tmp_path / "s")
    first = enrol(gateway.bundle(), state_dir, hostname="h", addresses=["10.0.0.5"])
    old_key = StateDir(state_dir).load_key()
    serial = credential_parse(StateDir(state_dir).load_credential())["serial"]
    done = run_cli(
        "enrol", "--reenrol", "--state-dir", state_dir, "--hostname", "h2", "--address", "10.0.0.6"
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"re-enrolled as workload {first.workload_id}")
    request = gateway.gateway.enrol_requests[-1]
    assert request["token"] == "" and request["workload_id"] == first.workload_id
    assert request["key_proof"]["serial"] == serial
    assert verify_key_proof(
        public_key_encode(old_key.public_key()),
        request["key_proof"]["signature"],
        workload_id=first.workload_id,
        serial=serial,
        public_key=request["public_key"],
        hostname="h2",
        addresses=["10.0.0.6"],
        signed_at=request["key_proof"]["signed_at"],
        gateway_fingerprint=gateway.gateway.fingerprint,
    )
    new_key = public_key_encode(StateDir(state_dir).load_key().public_key())
    assert new_key == request["public_key"] != public_key_encode(old_key.public_key())
    # The key that signed is gone from this host: the same proof again is refused.
    assert gateway.gateway.enrol(request)[0] == 401


def test_enrol_without_a_bundle_is_a_one_line_error(tmp_path):
    assert_one_line_error(
        run_cli("enrol", "--state-dir", str(tmp_path / "s")), "needs --bundle or --bundle-file"
    )


def test_refused_reenrolment_keeps_the_old_enrolment(gateway, tmp_path):
    state_dir = str(tmp_path / "s")
    first = enrol(gateway.bundle(), state_dir, hostname="h", addresses=[])
    gateway.gateway.serials[first.workload_id] += 1  # the key proof names a superseded credential
    before = {
        name: StateDir(state_dir).file(name).read_bytes()
        for name in ("key.pem", "credential", "identity.json")
    }
    used_up = gateway.bundle(uses=0)
    with pytest.raises(AgentError, match="enrolment refused"):
        enrol(used_up, state_dir, reenrol=True, hostname="h", addresses=[])
    after = {name: StateDir(state_dir).file(name).read_bytes() for name in before}
    assert after == before


def test_reenrol_without_enrolment(gateway, tmp_path):
    assert_one_line_error(
        run_cli("enrol", "--reenrol", "--bundle", gateway.bundle(), "--state-dir", str(tmp_path / "s")),
        "nothing to re-enrol",
    )


def test_bad_address_option(gateway, tmp_path):
    assert_one_line_error(
        run_cli(
            "enrol",
            "--bundle",
            gateway.bundle(),
            "--state-dir",
            str(tmp_path / "s"),
            "--address",
            "10.0.0.300",
        ),
        "'10.0.0.300' is not an IPv4 or IPv6 address",
    )


def test_credential_for_another_key_is_refused(gateway, tmp_path):
    identity = enrol(gateway.bundle(), str(tmp_path / "s"), hostname="h", addresses=[])
    issued = gateway.gateway.issue(identity.workload_id)
    response = EnrolResponse(
        workload_id=identity.workload_id,
        credential=issued.credential,
        signing_public_key=gateway.gateway.signing_public_key,
        expires_at=issued.expires_at,
        renewal_due_at=issued.renewal_due_at,
    )
    with pytest.raises(AgentError, match="credential for another key"):
        _check_credential(response, Ed25519PrivateKey.generate())
    forged = EnrolResponse(
        **{
            **response.__dict__,
            "signing_public_key": public_key_encode(Ed25519PrivateKey.generate().public_key()),
        }
    )
    with pytest.raises(AgentError, match="signature does not verify"):
        _check_credential(forged, Ed25519PrivateKey.generate())


def test_a_gateway_without_its_database_is_waited_out_as_its_retry_after_says(gateway, tmp_path, monkeypatch):
    import agent.enrol

    waits: list[float] = []
    monkeypatch.setattr(agent.enrol.time, "sleep", waits.append)
    gateway.gateway.enrolments_unavailable, gateway.gateway.retry_after = 2, "7"
    identity = enrol(gateway.bundle(), str(tmp_path / "state"), hostname="h", addresses=["10.0.0.1"])
    assert identity.workload_id and waits == [7.0, 7.0]


def test_a_gateway_unavailable_for_longer_is_a_one_line_error(gateway, tmp_path, monkeypatch):
    import agent.enrol

    monkeypatch.setattr(agent.enrol.time, "sleep", lambda seconds: None)
    gateway.gateway.enrolments_unavailable = 100
    with pytest.raises(AgentError) as refused:
        enrol(gateway.bundle(), str(tmp_path / "state"), hostname="h", addresses=["10.0.0.1"])
    assert "cannot reach its database" in refused.value.message
    assert "[HTTP 503 service-unavailable]" in refused.value.message
    assert not StateDir(tmp_path / "state").is_enrolled()

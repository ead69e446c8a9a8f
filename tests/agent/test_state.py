"""The state directory: file modes, atomic writes, and `status` read from status.json."""

from __future__ import annotations

import json
import os
import random
import stat
import threading
from datetime import UTC

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.backoff import BACKOFF_CAP, backoff_delay
from agent.credential import credential_payload, credential_sign, format_instant, public_key_encode
from agent.errors import AgentError
from agent.state import Identity, StateDir, write_atomically
from tests.support.agent_helpers import assert_one_line_error, run_cli


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def enrolled_state(path, *, workload_id="5b0c2d8e-0000-4000-8000-000000000001") -> StateDir:
    """A state directory as enrolment leaves it, signed by a throwaway control-plane key."""
    from datetime import datetime, timedelta

    state = StateDir(path)
    state.create()
    key = Ed25519PrivateKey.generate()
    signer = Ed25519PrivateKey.generate()
    now = datetime.now(UTC)
    payload = credential_payload(
        workload_id=workload_id,
        public_key=public_key_encode(key.public_key()),
        serial=1,
        issued_at=now,
        expires_at=now + timedelta(days=30),
    )
    state.write_key(key)
    state.write_credential(credential_sign(payload, signer))
    state.write_identity(
        Identity(
            workload_id=workload_id,
            gateway="gw.example:8443",
            fingerprint=":".join(["AB"] * 32),
            certificate_pem="-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
            signing_public_key=public_key_encode(signer.public_key()),
            hostname="web-1",
            enrolled_at=format_instant(now),
        )
    )
    return state


def test_state_dir_created_0700_and_files_0600(tmp_path):
    old_umask = os.umask(0)  # the most permissive umask must not leak into any mode
    try:
        state = enrolled_state(tmp_path / "deep" / "state")
    finally:
        os.umask(old_umask)
    assert _mode(state.path) == 0o700
    for name in ("key.pem", "credential", "identity.json"):
        assert _mode(state.file(name)) == 0o600, name
    assert isinstance(state.load_key(), Ed25519PrivateKey)


def test_existing_lax_state_dir_is_tightened(tmp_path):
    lax = tmp_path / "lax"
    lax.mkdir(mode=0o755)
    os.chmod(lax, 0o755)
    StateDir(lax).create()
    assert _mode(lax) == 0o700


def test_key_file_is_never_readable_by_others_while_written(tmp_path):
    """Watch the directory while keys are written: no file in it ever has group or other bits."""
    old_umask = os.umask(0)
    state = StateDir(tmp_path / "s")
    state.create()
    seen_modes: set[int] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for entry in os.scandir(state.path):
                try:
                    seen_modes.add(stat.S_IMODE(entry.stat().st_mode))
                except FileNotFoundError:
                    pass

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(200):
            state.write_key(Ed25519PrivateKey.generate())
    finally:
        stop.set()
        watcher.join()
        os.umask(old_umask)
    assert seen_modes and all(mode & 0o077 == 0 for mode in seen_modes), sorted(map(oct, seen_modes))


def test_write_atomically_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "f"
    for text in ("one", "two"):
        write_atomically(target, text.encode())
    assert target.read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_not_enrolled_and_damaged_state(tmp_path):
    with pytest.raises(AgentError, match="not enrolled: the state directory .* does not exist"):
        StateDir(tmp_path / "none").load_identity()
    (tmp_path / "empty").mkdir()
    with pytest.raises(AgentError, match="not enrolled: .*identity.json does not exist"):
        StateDir(tmp_path / "empty").load_identity()
    state = enrolled_state(tmp_path / "s")
    state.file("identity.json").write_text("{")
    with pytest.raises(AgentError, match="identity.json is damaged"):
        state.load_identity()
    state.file("key.pem").write_text("nope")
    with pytest.raises(AgentError, match="not an unencrypted Ed25519 private key"):
        state.load_key()


STATUS = {
    "pid": 2**22 + 12345,  # beyond pid_max: certainly not running
    "started_at": "2026-11-21T10:00:00.000000Z",
    "stream": {"state": "connected", "since": "2026-11-21T10:00:01.000000Z"},
    "last_error": {
        "message": "the stream closed with code 4503 shutting down",
        "at": "2026-11-21T09:59:00.000000Z",
    },
    "applied": {"version": "v42", "mode": "enforced", "at": "2026-11-21T10:00:02.000000Z"},
    "mode": "enforced",
    "owned_table": {"state": "present", "since": "2026-11-21T10:00:02.000000Z"},
    "credential": {
        "expires_at": "2026-12-21T10:00:00.000000Z",
        "renewal_due_at": "2026-12-11T10:00:00.000000Z",
        "state": "renews",
    },
    "updated_at": "2026-11-21T10:00:02.000000Z",
}


def test_status_from_status_json(tmp_path):
    state = enrolled_state(tmp_path / "s")
    state.write_status(STATUS)
    done = run_cli("status", "--state-dir", str(state.path), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["workload_id"] == "5b0c2d8e-0000-4000-8000-000000000001"
    assert doc["applied"] == STATUS["applied"]
    assert doc["owned_table"]["state"] == "present"
    assert doc["credential"]["renewal_due_at"] == STATUS["credential"]["renewal_due_at"]
    assert doc["last_error"]["message"].startswith("the stream closed with code 4503")
    # The writer is gone: its "connected" is stale, and status says so.
    assert doc["daemon"] == {"running": False, "pid": STATUS["pid"], "started_at": STATUS["started_at"]}
    assert doc["stream"]["state"] == "disconnected"

    text = run_cli("status", "--state-dir", str(state.path))
    assert text.returncode == 0, text.stderr
    assert "version v42 (mode enforced)" in text.stdout
    assert "owned table:  present since 2026-11-21T10:00:02.000000Z" in text.stdout
    assert "not running" in text.stdout
    assert "4503" in text.stdout


def test_status_of_a_live_daemon(tmp_path):
    state = enrolled_state(tmp_path / "s")
    state.write_status(dict(STATUS, pid=os.getpid()))
    doc = json.loads(run_cli("status", "--state-dir", str(state.path), "--json").stdout)
    assert doc["daemon"]["running"] is True
    assert doc["stream"]["state"] == "connected"


def test_status_before_the_daemon_ever_ran(tmp_path):
    state = enrolled_state(tmp_path / "s")
    done = run_cli("status", "--state-dir", str(state.path))
    assert done.returncode == 0, done.stderr
    assert "has not run yet" in done.stdout
    assert "expires 20" in done.stdout  # read from the credential itself


def test_status_json_broken(tmp_path):
    state = enrolled_state(tmp_path / "s")
    state.file("status.json").write_text("[")
    assert_one_line_error(run_cli("status", "--state-dir", str(state.path)), "status.json is not JSON")


def test_backoff_full_jitter_bounds():
    rng = random.Random(7)
    for attempt in range(12):
        ceiling = min(BACKOFF_CAP, 2**attempt)
        delays = [backoff_delay(attempt, rng) for _ in range(400)]
        assert all(0 <= d <= ceiling for d in delays), attempt
        # Full jitter spreads over the whole range, not just near the ceiling.
        assert min(delays) < ceiling * 0.1 and max(delays) > ceiling * 0.9
    assert max(backoff_delay(1000, rng) for _ in range(100)) <= 60

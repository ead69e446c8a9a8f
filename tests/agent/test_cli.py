"""The CLI's promise: every failure an operator can meet is one line, `palisade-agent: error: ...`,
and a non-zero exit, never a traceback. Run as a subprocess, as an operator would."""

from __future__ import annotations

import base64
import json
import os
import socket
import sys

import pytest

from agent.bundle import bundle_encode
from agent.cli import check_root, main
from agent.errors import AgentError
from tests.support.agent_helpers import assert_one_line_error, run_cli
from tests.support.requirements import require

FINGERPRINT = ":".join(["AB"] * 32)
TOKEN = "pal_pt_" + "x" * 32


def _raw_bundle(fields: object) -> str:
    raw = json.dumps(fields).encode()
    return "palisade-enrol-v1:" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


BAD_BUNDLES = {
    "empty": ("", "empty"),
    "not a bundle": ("hello", "not an enrolment bundle"),
    "bare token": (TOKEN, "bare provisioning token"),
    "newer version": ("palisade-enrol-v3:abc", "unsupported enrolment bundle version"),
    "truncated": ("palisade-enrol-v1:", "truncated"),
    "damaged": ("palisade-enrol-v1:!!!!", "damaged"),
    "not json": ("palisade-enrol-v1:" + base64.urlsafe_b64encode(b"nope").decode(), "not JSON"),
    "lacks token": (_raw_bundle({"gateway": "gw:8443", "fingerprint": FINGERPRINT}), "lacks token"),
    "bad fingerprint": (
        _raw_bundle({"gateway": "gw:8443", "fingerprint": "AB:CD", "token": TOKEN}),
        "not a SHA-256 fingerprint",
    ),
    "bad gateway": (_raw_bundle({"gateway": "gw", "fingerprint": FINGERPRINT, "token": TOKEN}), "HOST:PORT"),
}


@pytest.mark.parametrize("name", sorted(BAD_BUNDLES))
def test_bad_bundle_is_one_line_error(name, tmp_path):
    bundle, fragment = BAD_BUNDLES[name]
    done = run_cli("enrol", "--bundle", bundle, "--state-dir", str(tmp_path / "state"))
    assert_one_line_error(done, fragment)
    assert not (tmp_path / "state").exists(), "a refused bundle must leave no state behind"


def test_bundle_file_errors(tmp_path):
    assert_one_line_error(
        run_cli("enrol", "--bundle-file", str(tmp_path / "missing"), "--state-dir", str(tmp_path / "s")),
        "cannot read the bundle file",
    )
    wrapped = tmp_path / "bundle.txt"
    wrapped.write_text("not-a-bundle\n")
    assert_one_line_error(
        run_cli("enrol", "--bundle-file", str(wrapped), "--state-dir", str(tmp_path / "s")),
        "not an enrolment bundle",
    )


def test_usage_errors_are_one_line():
    assert_one_line_error(run_cli(), "required")
    assert_one_line_error(run_cli("enrol"), "--bundle")
    assert_one_line_error(run_cli("frobnicate"), "invalid choice")
    assert_one_line_error(run_cli("run", "--heartbeat-seconds", "soon"), "invalid float")
    simulate = ("simulate", "--bundle", "x", "--count", "1", "--state-root", "/nonexistent")
    assert_one_line_error(run_cli(*simulate, "--start-rate", "0"), "--start-rate must be positive")


def test_gateway_unreachable_is_one_line_error(tmp_path):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    bundle = bundle_encode(gateway=f"127.0.0.1:{port}", fingerprint=FINGERPRINT, token=TOKEN)
    done = run_cli("enrol", "--bundle", bundle, "--state-dir", str(tmp_path / "s"))
    assert_one_line_error(done, "cannot reach the gateway", f"127.0.0.1:{port}")


@pytest.mark.parametrize("command", ["run", "status"])
def test_not_enrolled(command, tmp_path):
    for state_dir in (tmp_path / "nowhere", tmp_path / "empty"):
        if state_dir.name == "empty":
            state_dir.mkdir()
        done = run_cli(command, "--state-dir", str(state_dir))
        line = assert_one_line_error(done)
        # `run` checks root first; as root (or for `status`) the missing enrolment is what is reported.
        if "needs root" in line and os.geteuid() != 0:
            continue
        assert "not enrolled" in line and "palisade-agent enrol" in line
        assert done.returncode == 3  # systemd's RestartPreventExitStatus: restarting cannot help


def test_state_dir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    assert_one_line_error(run_cli("status", "--state-dir", str(tmp_path / "file")), "is not a directory")


def test_unreadable_state_dir(tmp_path):
    """Run `status` as an unprivileged user against a root-only state directory."""
    require(os.geteuid() == 0, "needs root to switch to another user")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o755)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody and run the CLI in-process
        try:
            os.setgid(65534)
            os.setuid(65534)
            sys.stderr = os.fdopen(write_end, "w")  # pytest has replaced sys.stderr in this process
            code = main(["status", "--state-dir", str(state)])
        except BaseException:
            code = 99
        sys.stderr.flush()
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        stderr = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1
    assert stderr.count("\n") == 1 and stderr.startswith(
        "palisade-agent: error: cannot read the state directory"
    )


def test_check_root():
    check_root("run", euid=0)
    with pytest.raises(AgentError, match=r"'run' needs root"):
        check_root("run", euid=1000)
    with pytest.raises(AgentError, match=r"'remove-table' needs root"):
        check_root("remove-table", euid=1000)


def test_missing_libnftables_is_explained(monkeypatch):
    import builtins

    from agent import cli

    real_import = builtins.__import__

    def no_nftables(name, *args, **kwargs):
        if name == "nftables":
            raise ImportError("No module named 'nftables'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nftables)
    with pytest.raises(AgentError, match="python3-nftables"):
        cli.nftables_dataplane()


def test_unloadable_libnftables_is_explained(monkeypatch):
    import types

    from agent import cli

    fake = types.ModuleType("nftables")

    def broken():
        raise OSError("libnftables.so.1: cannot open shared object file")

    fake.Nftables = broken
    monkeypatch.setitem(sys.modules, "nftables", fake)
    with pytest.raises(AgentError, match="libnftables cannot be loaded"):
        cli.nftables_dataplane()


def test_agent_error_is_always_one_line():
    assert AgentError("first\nsecond\n  third").message == "first second third"

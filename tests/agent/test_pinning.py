"""Pinning: the agent trusts exactly the certificate its bundle names, and decides before it sends
a single request byte (so a wrong gateway never sees the token)."""

from __future__ import annotations

import datetime
import socket
import ssl
import threading

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.bundle import bundle_encode
from agent.enrol import enrol
from agent.errors import AgentError
from agent.tls import fetch_certificate, fingerprint_of, pin_gateway, pinned_context
from tests.support.agent_helpers import assert_one_line_error, run_cli

TOKEN = "pal_pt_" + "s" * 32


def throwaway_certificate(
    tmp_path, name: str, *, now: datetime.datetime | None = None
) -> tuple[str, str, str]:
    """(cert path, key path, fingerprint) of a fresh self-signed certificate, valid around `now`."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = now or datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path), cert.fingerprint(hashes.SHA256()).hex(":").upper()


class TinyTLSServer:
    """Accepts TLS connections on 127.0.0.1 and records every application byte a client sends."""

    def __init__(self, cert_path: str, key_path: str) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert_path, key_path)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = bytearray()
        self.handshakes = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn.settimeout(5)
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls:
                    self.handshakes += 1
                    while data := tls.recv(4096):
                        self.received += data
            except (OSError, ssl.SSLError):
                pass

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        except OSError:
            pass
        self.listener.close()
        self.thread.join(10)


@pytest.fixture
def server(tmp_path):
    cert, key, fingerprint = throwaway_certificate(tmp_path, "gateway")
    tiny = TinyTLSServer(cert, key)
    tiny.fingerprint = fingerprint
    yield tiny
    tiny.close()


def test_fetch_certificate_gets_the_servers_fingerprint(server):
    assert fingerprint_of(fetch_certificate(server.gateway)) == server.fingerprint
    assert pin_gateway(server.gateway, server.fingerprint.lower()).startswith("-----BEGIN CERTIFICATE-----")
    server.close()
    assert server.received == b""  # a handshake, and not one request byte


def test_mismatch_names_both_fingerprints_and_sends_nothing(server, tmp_path):
    wrong = ":".join(["0F"] * 32)
    bundle = bundle_encode(gateway=server.gateway, fingerprint=wrong, token=TOKEN)
    with pytest.raises(AgentError) as caught:
        enrol(bundle, str(tmp_path / "state"), hostname="h", addresses=[])
    assert server.fingerprint in caught.value.message and wrong in caught.value.message
    assert "the token was not sent" in caught.value.message

    done = run_cli("enrol", "--bundle", bundle, "--state-dir", str(tmp_path / "state2"))
    assert_one_line_error(done, server.fingerprint, wrong)
    server.close()
    assert server.handshakes >= 2
    assert server.received == b"", "the agent sent request bytes to a gateway it had not pinned"
    assert not (tmp_path / "state" / "identity.json").exists()


def test_pinned_context_refuses_another_certificate_in_the_handshake(server, tmp_path):
    other_cert, _, _ = throwaway_certificate(tmp_path, "other")
    context = pinned_context(open(other_cert).read())
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        with pytest.raises(ssl.SSLCertVerificationError):
            context.wrap_socket(sock, server_hostname=None)
    server.close()
    assert server.received == b""


def test_pinned_context_accepts_the_pinned_certificate(server, tmp_path):
    pem = pin_gateway(server.gateway, server.fingerprint)
    context = pinned_context(pem)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname is False
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        with context.wrap_socket(sock, server_hostname=None) as tls:  # no name check: the pin decides
            tls.sendall(b"hello")
    server.close()
    assert bytes(server.received) == b"hello"


@pytest.mark.parametrize("days", [2, -30], ids=["host clock behind", "host clock ahead"])
def test_the_pin_decides_whatever_this_hosts_clock_says(tmp_path, days):
    """A certificate not yet valid, or expired, by this host's clock: a host whose clock is off
    still connects (and the control plane shows its skew); another certificate is still refused."""
    cert, key, fingerprint = throwaway_certificate(
        tmp_path, "gateway", now=datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=days)
    )
    tiny = TinyTLSServer(cert, key)
    try:
        pem = pin_gateway(tiny.gateway, fingerprint)
        with socket.create_connection(("127.0.0.1", tiny.port), timeout=5) as sock:
            with pinned_context(pem).wrap_socket(sock, server_hostname=None) as tls:
                tls.sendall(b"ok")
        other, _, _ = throwaway_certificate(tmp_path, "other")
        with socket.create_connection(("127.0.0.1", tiny.port), timeout=5) as sock:
            with pytest.raises(ssl.SSLCertVerificationError):
                pinned_context(open(other).read()).wrap_socket(sock, server_hostname=None)
    finally:
        tiny.close()
    assert bytes(tiny.received) == b"ok"


def test_pinned_context_accepts_a_certificate_made_by_the_control_plane(tmp_path):
    """The real gateway's generated certificate (CA:FALSE, self-signed) works as the only anchor."""
    from controlplane.tls import ensure_certificate

    made = ensure_certificate(tmp_path, "gateway", [])
    tiny = TinyTLSServer(str(made.cert_path), str(made.key_path))
    try:
        pem = pin_gateway(tiny.gateway, made.fingerprint)
        with socket.create_connection(("127.0.0.1", tiny.port), timeout=5) as sock:
            with pinned_context(pem).wrap_socket(sock, server_hostname=None) as tls:
                tls.sendall(b"ok")
    finally:
        tiny.close()
    assert bytes(tiny.received) == b"ok"


def test_damaged_pinned_certificate():
    with pytest.raises(AgentError, match="pinned gateway certificate .* is damaged"):
        pinned_context("not a certificate")

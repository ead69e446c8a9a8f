"""Pinning the gateway's TLS certificate: no CA, just the certificate the enrolment bundle names.

At enrolment the agent fetches the certificate with a handshake that verifies nothing and sends no
request bytes, and compares its SHA-256 fingerprint with the bundle's. From then on every connection
uses a context whose only trust anchor is that certificate, so the check happens inside the TLS
handshake, before the agent sends a token, a credential or a proof.
"""

from __future__ import annotations

import hashlib
import socket
import ssl

from cryptography import x509

from agent.errors import AgentError, GatewayUnreachable

X509_V_FLAG_NO_CHECK_TIME = 0x200000  # OpenSSL's; Python's ssl module has no name for it


def split_gateway(gateway: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port" (as the bundle checked it)."""
    host, _, port = gateway.rpartition(":")
    return host.strip("[]"), int(port)


def fingerprint_of(der: bytes) -> str:
    """SHA-256 of a DER certificate in upper-case colon hex, as `openssl x509 -fingerprint -sha256`."""
    return hashlib.sha256(der).digest().hex(":").upper()


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True


def fetch_certificate(gateway: str, *, timeout: float = 10.0) -> bytes:
    """The DER certificate the gateway presents. Verifies nothing: only for comparing fingerprints."""
    host, port = split_gateway(gateway)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            with context.wrap_socket(sock, server_hostname=None if _is_ip(host) else host) as tls:
                der = tls.getpeercert(binary_form=True)
    except ssl.SSLError as error:
        raise AgentError(
            f"TLS handshake with the gateway {gateway} failed: {error.reason or error}"
        ) from None
    except TimeoutError:
        raise GatewayUnreachable(
            f"cannot reach the gateway {gateway}: timed out after {timeout:g} s"
        ) from None
    except OSError as error:
        raise GatewayUnreachable(f"cannot reach the gateway {gateway}: {error.strerror or error}") from None
    if not der:
        raise AgentError(f"the gateway {gateway} presented no certificate")
    return der


def pin_gateway(gateway: str, expected_fingerprint: str, *, timeout: float = 10.0) -> str:
    """The gateway's certificate as PEM, if its fingerprint is the expected one; AgentError naming
    both fingerprints otherwise."""
    der = fetch_certificate(gateway, timeout=timeout)
    actual = fingerprint_of(der)
    expected = expected_fingerprint.upper()
    if actual != expected:
        raise AgentError(
            f"the gateway {gateway} presented a certificate with SHA-256 fingerprint {actual}, "
            f"but the enrolment bundle pins {expected}; the token was not sent "
            "(check the bundle, or whether something intercepts the connection)"
        )
    return ssl.DER_cert_to_PEM_cert(der)


def pinned_context(certificate_pem: str) -> ssl.SSLContext:
    """A client context that trusts exactly the pinned certificate."""
    try:
        x509.load_pem_x509_certificate(certificate_pem.encode())
    except ValueError:
        raise AgentError("the pinned gateway certificate in identity.json is damaged; enrol again") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # the pin, not a name, identifies the gateway
    context.verify_mode = ssl.CERT_REQUIRED
    # A CA-issued gateway certificate pinned as the leaf is a trust anchor too.
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    # The pin, not this host's clock, decides: with validity dates checked, a host whose clock runs
    # an hour behind a new control plane's certificate could never connect, and so never show the
    # operator its clock skew. (The pinned certificate is trusted until the host is enrolled again.)
    context.verify_flags |= X509_V_FLAG_NO_CHECK_TIME
    context.load_verify_locations(cadata=certificate_pem)
    return context

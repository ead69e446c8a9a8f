"""The listeners' TLS certificates: generated and kept in the data directory, or given by the operator.

A generated certificate is self-signed and made once; later starts reuse it, because agents and
operators pin its SHA-256 fingerprint. A later start that asks for subject alternative names the stored
certificate lacks only gets a warning: regenerating would change the fingerprint behind everyone's back.
Deleting both files makes the next start generate a new certificate (and a new fingerprint).
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import logging
import os
import re
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger("palisade.tls")

VALIDITY = datetime.timedelta(days=3650)
# Clients whose clock runs a little behind must not see a certificate from the future.
BACKDATE = datetime.timedelta(hours=1)
_DNS_NAME = re.compile(
    r"^(\*\.)?[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})?(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})?)*\.?$"
)
_PEM_CERTIFICATE = re.compile(
    rb"-----BEGIN CERTIFICATE-----\r?\n.+?\r?\n-----END CERTIFICATE-----", re.DOTALL
)


class CertificateError(Exception):
    """A certificate or key that cannot be used; the message is one line for the operator."""


@dataclass(frozen=True)
class CertPaths:
    cert_path: Path
    key_path: Path
    fingerprint: str
    # Intermediates from an operator-given certificate file, re-served after the certificate.
    chain_path: Path | None = None


def fingerprint_of(pem_bytes: bytes) -> str:
    """SHA-256 of the (first) certificate's DER, as `openssl x509 -noout -fingerprint -sha256` prints it."""
    cert = x509.load_pem_x509_certificate(pem_bytes)
    return cert.fingerprint(hashes.SHA256()).hex(":").upper()


def default_sans() -> list[str]:
    return [socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1", "::1"]


def parse_san(value: str) -> x509.GeneralName:
    """One subject alternative name: an IP address (brackets allowed around IPv6) or a DNS name."""
    text = value.strip()
    try:
        return x509.IPAddress(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        pass
    if not text or len(text) > 253 or not _DNS_NAME.match(text):
        raise CertificateError(f"{value!r} is neither an IP address nor a DNS name")
    return x509.DNSName(text.rstrip(".").lower())


def _san_key(name: x509.GeneralName) -> str:
    return str(name.value).lower()


def _wanted_sans(sans: list[str]) -> list[x509.GeneralName]:
    names: dict[str, x509.GeneralName] = {}
    for value in default_sans() + list(sans):
        name = parse_san(value)
        names.setdefault(_san_key(name), name)
    return list(names.values())


def ensure_certificate(data_dir: Path | str, name: str, sans: list[str]) -> CertPaths:
    """The self-signed certificate `<name>-cert.pem` / `<name>-key.pem` in `data_dir`: made on first
    use, reused afterwards. `sans` are extra subject alternative names beyond the host's own."""
    data_dir = Path(data_dir)
    cert_path, key_path = data_dir / f"{name}-cert.pem", data_dir / f"{name}-key.pem"
    wanted = _wanted_sans(sans)
    with _locked(data_dir / f".{name}-cert.lock"):
        if cert_path.exists():
            paths = load_certificate(cert_path, key_path, what=f"stored {name}")
            _warn_missing_sans(name, cert_path, wanted)
            return paths
        # A key without a certificate is left from an interrupted first start: nobody pinned it.
        _generate(cert_path, key_path, name, wanted)
        log.info("generated a self-signed %s certificate %s", name, cert_path)
        return load_certificate(cert_path, key_path, what=f"generated {name}")


def _warn_missing_sans(name: str, cert_path: Path, wanted: list[x509.GeneralName]) -> None:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        present = {
            _san_key(n) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        }
    except x509.ExtensionNotFound:
        present = set()
    missing = [str(n.value) for n in wanted if _san_key(n) not in present]
    if missing:
        log.warning(
            "the stored %s certificate %s lacks the names %s; keeping it so pinned fingerprints stay valid "
            "(delete %s and its key to generate a new one)",
            name,
            cert_path,
            ", ".join(missing),
            cert_path.name,
        )


@contextmanager
def _locked(lock_path: Path):
    """Two processes starting on one data directory must not each generate their own certificate."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _generate(cert_path: Path, key_path: Path, name: str, sans: list[x509.GeneralName]) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Palisade"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"Palisade {name} ({socket.gethostname()})"[:64]),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # The key first: a start interrupted between the two renames leaves a key without a certificate,
    # which the next start replaces; never a certificate whose key is lost.
    _write_atomically(key_path, key_pem, 0o600)
    _write_atomically(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # Created with its final mode: the key is never readable by others, not even for a moment.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_certificate(
    cert_path: Path | str, key_path: Path | str, *, what: str = "TLS", chain_path: Path | None = None
) -> CertPaths:
    """Check that a certificate file and a private key file exist, parse, and belong together.
    When the certificate file also holds intermediates (a "fullchain" file), they are written to
    `chain_path`, since the TLS endpoint serves only the first certificate of the file itself."""
    cert_path, key_path = Path(cert_path).resolve(), Path(key_path).resolve()
    cert_pem = _read(cert_path, f"{what} certificate")
    key_pem = _read(key_path, f"{what} key")
    blocks = _PEM_CERTIFICATE.findall(cert_pem)
    try:
        cert = x509.load_pem_x509_certificate(blocks[0] if blocks else cert_pem)
    except ValueError:
        raise CertificateError(f"{what} certificate {cert_path} is not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise CertificateError(f"{what} key {key_path} is encrypted; give an unencrypted PEM key") from None
    except (ValueError, serialization.UnsupportedAlgorithm):
        raise CertificateError(f"{what} key {key_path} is not a PEM private key") from None
    if _spki(cert.public_key()) != _spki(key.public_key()):
        raise CertificateError(f"{what} key {key_path} does not belong to the certificate {cert_path}")
    if key_path.stat().st_mode & 0o077:
        log.warning(
            "%s key %s is readable by other users (mode %o)", what, key_path, key_path.stat().st_mode & 0o777
        )
    if len(blocks) > 1 and chain_path is not None:
        _write_atomically(chain_path, b"\n".join(blocks[1:]) + b"\n", 0o644)
    else:
        chain_path = None
    return CertPaths(cert_path, key_path, fingerprint_of(blocks[0] if blocks else cert_pem), chain_path)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CertificateError(f"{what} {path} does not exist") from None
    except OSError as error:
        raise CertificateError(f"cannot read {what} {path}: {error.strerror}") from None


def _spki(public_key) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )

"""The agent credential: what the control plane signs at enrolment and at each renewal.

A credential is one line of compact JSON::

    {"payload":"<base64url of the payload bytes>","signature":"<base64url of the Ed25519 signature>"}

base64url without padding. The payload bytes are compact JSON::

    {"v":1,"workload_id":"<uuid>","public_key":"<base64 raw Ed25519 key of the agent>",
     "serial":<int>,"issued_at":"<RFC 3339 UTC>","expires_at":"<RFC 3339 UTC>"}

The signature is the control plane's Ed25519 signature over `SIGNING_CONTEXT + payload bytes` (the
context keeps these signatures from ever being valid for anything else the key might sign). The
signature covers the exact bytes carried, so nobody needs to re-serialise JSON identically to verify.
Public keys, the agent's and the control plane's, are the raw 32 bytes in standard base64.

Standard library and `cryptography` only: the control plane signs with this module, and the agent
checks what it was given with it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from datetime import UTC, datetime
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

CREDENTIAL_VERSION = 1
SIGNING_CONTEXT = b"palisade-credential-v1\n"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
PAYLOAD_FIELDS = ("v", "workload_id", "public_key", "serial", "issued_at", "expires_at")
MAX_CREDENTIAL_LENGTH = 4096

_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")


class CredentialError(ValueError):
    """A credential or key that cannot be used; the message is one line."""


def b64url_encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str, what: str) -> bytes:
    if not isinstance(text, str) or not _BASE64URL.fullmatch(text) or len(text) % 4 == 1:
        raise CredentialError(f"the credential's {what} is not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def public_key_encode(key: Ed25519PublicKey) -> str:
    """Standard base64 of the raw 32-byte key (44 characters)."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode("ascii")


def public_key_decode(text: object) -> Ed25519PublicKey:
    """An Ed25519 public key from standard base64 of its raw 32 bytes."""
    if not isinstance(text, str) or not _BASE64.fullmatch(text):
        raise CredentialError("the public key must be standard base64 of the raw 32-byte Ed25519 key")
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error:
        raise CredentialError(
            "the public key must be standard base64 of the raw 32-byte Ed25519 key"
        ) from None
    if len(raw) != PUBLIC_KEY_BYTES:
        raise CredentialError(f"the public key has {len(raw)} bytes; an Ed25519 key has {PUBLIC_KEY_BYTES}")
    try:
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise CredentialError("the public key is not a valid Ed25519 key") from None


def public_key_fingerprint(text: str) -> str:
    """`sha256:` and the hex SHA-256 of the raw key: how logs and the audit trail name a key."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raw = str(text).encode()
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def format_instant(instant: datetime) -> str:
    """RFC 3339 in UTC with a `Z`, to the microsecond."""
    if instant.tzinfo is None:
        raise ValueError("instants must carry a time zone")
    return instant.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_instant(text: object) -> datetime:
    if not isinstance(text, str) or not text.endswith("Z"):
        raise CredentialError(f"{text!r} is not an RFC 3339 UTC instant")
    try:
        return datetime.fromisoformat(text[:-1] + "+00:00")
    except ValueError:
        raise CredentialError(f"{text!r} is not an RFC 3339 UTC instant") from None


def credential_payload(
    *, workload_id: str, public_key: str, serial: int, issued_at: datetime, expires_at: datetime
) -> dict[str, Any]:
    return {
        "v": CREDENTIAL_VERSION,
        "workload_id": str(workload_id),
        "public_key": public_key,
        "serial": int(serial),
        "issued_at": format_instant(issued_at),
        "expires_at": format_instant(expires_at),
    }


def credential_sign(payload: dict[str, Any], private_key: Ed25519PrivateKey) -> str:
    """The credential text for `payload`, signed with `private_key`."""
    raw = json.dumps(payload, separators=(",", ":")).encode()
    signature = private_key.sign(SIGNING_CONTEXT + raw)
    return json.dumps(
        {"payload": b64url_encode(raw), "signature": b64url_encode(signature)}, separators=(",", ":")
    )


def _check_payload(payload: object) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise CredentialError("the credential's payload is not a JSON object")
    if payload.get("v") != CREDENTIAL_VERSION:
        raise CredentialError(
            f"unsupported credential version {payload.get('v')!r}; expected {CREDENTIAL_VERSION}"
        )
    missing = [name for name in PAYLOAD_FIELDS if name not in payload]
    if missing:
        raise CredentialError(f"the credential's payload lacks {', '.join(missing)}")
    if not isinstance(payload["workload_id"], str) or not payload["workload_id"]:
        raise CredentialError("the credential's workload_id is not a string")
    public_key_decode(payload["public_key"])
    serial = payload["serial"]
    if isinstance(serial, bool) or not isinstance(serial, int) or serial < 1:
        raise CredentialError("the credential's serial is not a positive integer")
    if parse_instant(payload["expires_at"]) <= parse_instant(payload["issued_at"]):
        raise CredentialError("the credential expires before it was issued")
    return payload


def _split(text: object) -> tuple[bytes, bytes]:
    if not isinstance(text, str) or len(text) > MAX_CREDENTIAL_LENGTH:
        raise CredentialError(f"the credential must be text of at most {MAX_CREDENTIAL_LENGTH} characters")
    try:
        outer = json.loads(text)
    except ValueError:
        raise CredentialError("the credential is not JSON") from None
    if not isinstance(outer, dict) or set(outer) != {"payload", "signature"}:
        raise CredentialError('the credential must be a JSON object with exactly "payload" and "signature"')
    raw = b64url_decode(outer["payload"], "payload")
    signature = b64url_decode(outer["signature"], "signature")
    if len(signature) != SIGNATURE_BYTES:
        raise CredentialError("the credential's signature is not an Ed25519 signature")
    return raw, signature


def _payload_of(raw: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise CredentialError("the credential's payload is not JSON") from None
    return _check_payload(payload)


def credential_parse(text: object) -> dict[str, Any]:
    """The payload of a well-formed credential, WITHOUT checking its signature (for display only)."""
    raw, _ = _split(text)
    return _payload_of(raw)


def credential_verify(text: object, signer_public_key: Ed25519PublicKey | str) -> dict[str, Any]:
    """The payload of a credential whose signature verifies with `signer_public_key` (the control
    plane's key, as an object or in base64); CredentialError otherwise. Expiry is not checked here:
    what an expired credential may still do is the caller's decision."""
    if isinstance(signer_public_key, str):
        signer_public_key = public_key_decode(signer_public_key)
    raw, signature = _split(text)
    try:
        signer_public_key.verify(signature, SIGNING_CONTEXT + raw)
    except InvalidSignature:
        raise CredentialError(
            "the credential's signature does not verify: it was altered or signed by another key"
        ) from None
    return _payload_of(raw)

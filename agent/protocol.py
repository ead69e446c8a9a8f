"""The agent wire protocol, version 1: typed messages between the agent and the gateway.

Standard library and `cryptography` only. The agent and the gateway both import this module, so there
is one definition of every message. docs/protocol.md describes the conversation; the golden files in
tests/golden/protocol/ pin the exact bytes, and both sides' tests read them.

Every stream message is a JSON object in one websocket text frame with `"v": 1` and a `"type"`.
Decoding checks the version, the type, every field's presence and JSON type, and rejects unknown
fields; a violation raises `ProtocolError` carrying the websocket close code to use.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from email.utils import parsedate_to_datetime
from typing import Any, ClassVar, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # a snapshot of a large policy fits
STREAM_PATH = "/agent/v1/stream"
ENROL_PATH = "/agent/v1/enrol"
PROOF_CONTEXT = b"palisade-stream-proof-v1\n"

# A gateway answering 503 (its database away) or 429 says in Retry-After when to come back; the agent
# waits that long, up to this, before it reports, enrols or connects again.
RETRY_AFTER_STATUSES = (429, 503)
MAX_RETRY_AFTER_SECONDS = 600.0


def retry_after(status: int, value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a 429 or 503's Retry-After (delta-seconds or an HTTP-date), None when
    there is none to honour."""
    if status not in RETRY_AFTER_STATUSES or not value:
        return None
    value = value.strip()
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - (time.time() if now is None else now)
        except (TypeError, ValueError, IndexError):
            return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)


def close_reason_retry_after(reason: str) -> float | None:
    """The wait a 4503 close asks for in its reason (`database unavailable: retry after 9 s`)."""
    match = _RETRY_AFTER_REASON.search(reason or "")
    return min(float(match[1]), MAX_RETRY_AFTER_SECONDS) if match else None


_RETRY_AFTER_REASON = re.compile(r"retry after ([0-9]{1,6}) s\b")


# Websocket close codes (4000-4999 are the application's).
CLOSE_MALFORMED = 4000  # not JSON, a missing or mistyped field, an unknown field
CLOSE_UNEXPECTED = 4001  # a message that is valid but not allowed now
CLOSE_VERSION = 4002  # a protocol version this side does not speak
CLOSE_UNAUTHENTICATED = 4401  # bad proof, unknown workload, impostor key, bad credential
CLOSE_FORBIDDEN = 4403  # credential beyond its grace: the workload must re-enrol
CLOSE_NOT_FOUND = 4404  # no such stream path
CLOSE_HANDSHAKE_TIMEOUT = 4408
CLOSE_REPLACED = 4409  # a newer stream of the same workload took over
CLOSE_CREDENTIAL_REVOKED = 4410  # the operator revoked the credential: only a consented re-enrolment helps
CLOSE_RECONNECT = 4100  # the operator asked for a fresh snapshot: reconnect now
CLOSE_SHUTDOWN = 4503  # the control plane is shutting down or its database is away: reconnect with backoff
CLOSE_TRY_AGAIN = 4500  # the control plane failed on its side (e.g. during a renewal): reconnect with backoff


class ProtocolError(ValueError):
    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason[:120]  # websocket close reasons are limited to 123 bytes


def b64encode(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def b64decode(text: str, *, what: str, length: int | None = None) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ProtocolError(CLOSE_MALFORMED, f"{what} is not base64") from None
    if length is not None and len(raw) != length:
        raise ProtocolError(CLOSE_MALFORMED, f"{what} must be {length} bytes")
    return raw


def proof_message(*, nonce: bytes, workload_id: str, gateway_fingerprint: str) -> bytes:
    """What the agent signs to prove possession of its key: bound to this server nonce, this
    workload and the gateway certificate it pinned, so a proof cannot be replayed or relayed."""
    return PROOF_CONTEXT + nonce + b"\n" + workload_id.encode() + b"\n" + gateway_fingerprint.upper().encode()


def sign_proof(key: Ed25519PrivateKey, **binding: Any) -> str:
    return b64encode(key.sign(proof_message(**binding)))


def verify_proof(public_key_b64: str, signature_b64: str, **binding: Any) -> bool:
    try:
        key = Ed25519PublicKey.from_public_bytes(b64decode(public_key_b64, what="public key", length=32))
        key.verify(b64decode(signature_b64, what="signature", length=64), proof_message(**binding))
    except (InvalidSignature, ProtocolError, ValueError):
        return False
    return True


_TYPES: dict[type, tuple[type, ...]] = {
    str: (str,),
    int: (int,),
    float: (int, float),
    bool: (bool,),
    dict: (dict,),
    list: (list,),
}


@dataclass(frozen=True)
class Message:
    type: ClassVar[str]
    direction: ClassVar[str]  # "agent" (agent -> gateway) or "gateway"

    def to_dict(self) -> dict[str, Any]:
        return {"v": PROTOCOL_VERSION, "type": self.type, **asdict(self)}

    def encode(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Message:
        known = {f.name: f for f in fields(cls)}
        unknown = set(data) - set(known) - {"v", "type"}
        if unknown:
            raise ProtocolError(CLOSE_MALFORMED, f"{cls.type}: unknown field {sorted(unknown)[0]!r}")
        values: dict[str, Any] = {}
        for name, spec in known.items():
            if name not in data:
                if spec.default is MISSING and spec.default_factory is MISSING:
                    raise ProtocolError(CLOSE_MALFORMED, f"{cls.type}: missing field {name!r}")
                continue
            value = data[name]
            expected = _TYPES[_FIELD_TYPES[cls][name]]
            optional = _OPTIONAL[cls][name]
            if value is None and optional:
                values[name] = None
                continue
            if isinstance(value, bool) and bool not in expected or not isinstance(value, expected):
                raise ProtocolError(CLOSE_MALFORMED, f"{cls.type}: field {name!r} has the wrong type")
            values[name] = value
        return cls(**values)


_REGISTRY: dict[str, type[Message]] = {}
_FIELD_TYPES: dict[type, dict[str, type]] = {}
_OPTIONAL: dict[type, dict[str, bool]] = {}


MessageClass = TypeVar("MessageClass", bound="type[Message]")


def message(type_name: str, direction: str) -> Callable[[MessageClass], MessageClass]:
    """Register a message class: its field annotations become the wire schema."""

    def register(cls: MessageClass) -> MessageClass:
        cls = dataclass(frozen=True)(cls)  # type: ignore[assignment]  # the same class, now a dataclass
        cls.type = type_name
        cls.direction = direction
        hints: dict[str, type] = {}
        optional: dict[str, bool] = {}
        for f in fields(cls):
            text = f.type if isinstance(f.type, str) else f.type.__name__
            optional[f.name] = "None" in text
            base = text.replace("| None", "").strip()
            hints[f.name] = {
                "str": str,
                "int": int,
                "float": float,
                "bool": bool,
                "dict": dict,
                "list": list,
            }[base.split("[")[0]]
        _FIELD_TYPES[cls] = hints
        _OPTIONAL[cls] = optional
        _REGISTRY[type_name] = cls
        return cls

    return register


# --- gateway -> agent ---


@message("hello", "gateway")
class Hello(Message):
    nonce: str  # base64 of 32 random bytes, fresh for each stream
    server_time: str  # RFC 3339
    protocol: int = PROTOCOL_VERSION


@message("welcome", "gateway")
class Welcome(Message):
    """The proof was accepted. When `renew_only`, the credential has expired within its grace: the
    only message the gateway accepts is `renew`; any other closes the stream with CLOSE_UNEXPECTED."""

    workload_id: str
    credential_state: str  # renews | renewal-failed | expired
    expires_at: str
    renewal_due_at: str
    renew_only: bool = False


@message("snapshot", "gateway")
class Snapshot(Message):
    version: str
    mode: str
    document: str  # the complete `table inet palisade { ... }`
    rule_index: dict = field(default_factory=dict)


@message("credential", "gateway")
class CredentialIssued(Message):
    credential: str
    expires_at: str
    renewal_due_at: str


@message("gateways", "gateway")
class Gateways(Message):
    """Every gateway of the control plane, in the order the agent should try them: sent after `welcome`
    and whenever the operator changes the list (`serve --gateway-advertise`), only to agents whose
    `auth` named the gateway they dialed (older agents know no such message)."""

    addresses: list


@message("reconnect", "gateway")
class Reconnect(Message):
    """Close this stream and open a new one at once; the new stream begins with a fresh snapshot."""

    reason: str = "resend-snapshot"


# --- agent -> gateway ---


@message("auth", "agent")
class Auth(Message):
    workload_id: str
    credential: str
    proof: str  # base64 Ed25519 signature over proof_message(nonce, workload_id, gateway fingerprint)
    agent_version: str
    process_start_id: str
    uptime_seconds: float
    owned_table: str  # present | absent | unknown
    # The list entry (HOST:PORT) the agent dialed for this stream; absent from agents that know one
    # gateway (and left out when None, so the frame is what such agents send).
    gateway: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        if data["gateway"] is None:
            del data["gateway"]
        return data


@message("applied", "agent")
class Applied(Message):
    version: str


@message("failed", "agent")
class Failed(Message):
    version: str
    error: str  # libnftables' error text


@message("heartbeat", "agent")
class Heartbeat(Message):
    process_start_id: str  # random per agent process: a new id means the agent restarted
    uptime_seconds: float
    clock: str  # the agent's clock, RFC 3339, for skew detection
    owned_table: str  # present | absent | unknown
    # The start (agent clock, RFC 3339) of the oldest flow window or gap the agent holds that the
    # control plane has not acknowledged; None when it holds none. Evidence from then on is not there yet.
    flow_backlog_since: str | None = None


@message("table", "agent")
class TableState(Message):
    """Sent as soon as the agent sees its owned table deleted from outside (or back)."""

    state: str  # present | absent


@message("table_modified", "agent")
class TableModified(Message):
    """Another process changed the owned table (a rule, chain, set or element added, removed or
    replaced) and the agent put its applied document back in one atomic replace."""

    modified_at: str  # when the agent first saw the change, RFC 3339 (the agent's clock)
    restored_at: str | None  # when the document was back; None when the restore failed
    description: str  # what differed, e.g. "chain input: 1 rule added"


@message("renew", "agent")
class Renew(Message):
    pass


@message("renewal_failed", "agent")
class RenewalFailed(Message):
    error: str


OWNED_TABLE_STATES = ("present", "absent", "unknown")


def decode(text: str | bytes, *, sender: str) -> Message:
    """Parse one frame sent by `sender` ("agent" or "gateway")."""
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError:
            raise ProtocolError(CLOSE_MALFORMED, "frame is not UTF-8") from None
    if len(text) > MAX_MESSAGE_BYTES:
        raise ProtocolError(CLOSE_MALFORMED, "message too large")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise ProtocolError(CLOSE_MALFORMED, "message is not JSON") from None
    if not isinstance(data, dict):
        raise ProtocolError(CLOSE_MALFORMED, "message is not a JSON object")
    if data.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(CLOSE_VERSION, f"protocol version {data.get('v')!r} is not {PROTOCOL_VERSION}")
    type_name = data.get("type")
    cls = _REGISTRY.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ProtocolError(CLOSE_MALFORMED, f"unknown message type {data.get('type')!r}")
    if cls.direction != sender:
        raise ProtocolError(CLOSE_UNEXPECTED, f"{cls.type} is not sent by the {sender}")
    return cls.from_dict(data)


# --- enrolment, over HTTPS POST ENROL_PATH ---


KEY_PROOF_CONTEXT = b"palisade-key-rotation-v1\n"
KEY_PROOF_MAX_SKEW_SECONDS = 300  # how far `signed_at` may be from the gateway's clock, either way


@dataclass(frozen=True)
class EnrolRequest:
    token: str  # empty for a key-signed rotation without a token
    public_key: str  # base64 raw Ed25519
    hostname: str
    addresses: list
    agent_version: str
    workload_id: str | None = None  # re-enrolment of an existing workload
    # A re-enrolment signed with the workload's current key: {"serial", "signed_at", "signature"}.
    key_proof: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        data = {"v": PROTOCOL_VERSION, **asdict(self)}
        if self.key_proof is None:
            del data["key_proof"]
        return data


def key_proof_message(
    *,
    workload_id: str,
    serial: int,
    public_key: str,
    hostname: str,
    addresses: list,
    signed_at: str,
    gateway_fingerprint: str,
) -> bytes:
    """What an agent signs with its current key to re-enrol its workload under a new key: the request's
    content (new key, host name, addresses as sent), the workload and the serial of its current
    credential (every enrolment and renewal moves it on, so a proof is good for one enrolment at most),
    the instant of signing (the gateway refuses old ones) and the gateway certificate it pinned."""
    content = {
        "workload_id": workload_id,
        "serial": serial,
        "public_key": public_key,
        "hostname": hostname,
        "addresses": addresses,
        "signed_at": signed_at,
        "gateway_fingerprint": gateway_fingerprint.upper(),
    }
    return KEY_PROOF_CONTEXT + json.dumps(content, sort_keys=True, separators=(",", ":")).encode()


def sign_key_proof(key: Ed25519PrivateKey, *, serial: int, signed_at: str, **content: Any) -> dict[str, Any]:
    """The `key_proof` of a re-enrolment request (content: key_proof_message's other arguments)."""
    signature = key.sign(key_proof_message(serial=serial, signed_at=signed_at, **content))
    return {"serial": serial, "signed_at": signed_at, "signature": b64encode(signature)}


def verify_key_proof(public_key_b64: str, signature_b64: str, **content: Any) -> bool:
    try:
        key = Ed25519PublicKey.from_public_bytes(b64decode(public_key_b64, what="public key", length=32))
        key.verify(b64decode(signature_b64, what="signature", length=64), key_proof_message(**content))
    except (InvalidSignature, ProtocolError, ValueError, TypeError):
        return False
    return True


@dataclass(frozen=True)
class EnrolResponse:
    workload_id: str
    credential: str
    signing_public_key: str  # the control plane's credential-signing key, base64 raw Ed25519
    expires_at: str
    renewal_due_at: str

    def to_dict(self) -> dict[str, Any]:
        return {"v": PROTOCOL_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Any) -> EnrolResponse:
        if not isinstance(data, dict) or data.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(CLOSE_VERSION, "the enrolment response is not protocol version 1")
        try:
            values = {f.name: data[f.name] for f in fields(cls)}
        except KeyError as missing:
            raise ProtocolError(CLOSE_MALFORMED, f"the enrolment response lacks {missing}") from None
        if not all(isinstance(v, str) for v in values.values()):
            raise ProtocolError(CLOSE_MALFORMED, "the enrolment response has a field of the wrong type")
        return cls(**values)


# --- flow reports, over HTTPS POST FLOWS_PATH ---
#
# Independent of the sync stream: an agent whose stream is down still reports. The body is a JSON
# object (FlowReport below); the request carries the workload id, its credential, and an Ed25519
# signature of the body's SHA-256 bound to the workload and the pinned gateway certificate.

FLOWS_PATH = "/agent/v1/flows"
FLOW_REPORT_CONTEXT = b"palisade-flow-report-v1\n"
HEADER_WORKLOAD = "Palisade-Workload"
HEADER_CREDENTIAL = "Palisade-Credential"
HEADER_SIGNATURE = "Palisade-Signature"


def flow_report_message(*, body: bytes, workload_id: str, gateway_fingerprint: str) -> bytes:
    digest = hashlib.sha256(body).hexdigest().encode()
    return (
        FLOW_REPORT_CONTEXT
        + digest
        + b"\n"
        + workload_id.encode()
        + b"\n"
        + gateway_fingerprint.upper().encode()
    )


def sign_flow_report(
    key: Ed25519PrivateKey, *, body: bytes, workload_id: str, gateway_fingerprint: str
) -> str:
    return b64encode(
        key.sign(
            flow_report_message(body=body, workload_id=workload_id, gateway_fingerprint=gateway_fingerprint)
        )
    )


def verify_flow_report(
    public_key_b64: str, signature_b64: str, *, body: bytes, workload_id: str, gateway_fingerprint: str
) -> bool:
    try:
        key = Ed25519PublicKey.from_public_bytes(b64decode(public_key_b64, what="public key", length=32))
        key.verify(
            b64decode(signature_b64, what="signature", length=64),
            flow_report_message(body=body, workload_id=workload_id, gateway_fingerprint=gateway_fingerprint),
        )
    except (InvalidSignature, ProtocolError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class FlowReport:
    """The body of a flow report: closed windows and gaps as the agent's buffer keeps them (instants
    as RFC 3339 text), with the agent's clock and which process sent it (for clock skew and for
    telling a silent agent from a quiet one). The gateway checks a body against these fields
    (flows/reports.py); the field order is the body's (tests/golden/flows/ pins it)."""

    type: ClassVar[str] = "flow_report"

    agent_clock: str
    process_start_id: str
    uptime_seconds: float
    window_seconds: int
    windows: list
    gaps: list

    def to_dict(self) -> dict[str, Any]:
        # Not asdict(): it would copy every window and group of a report of megabytes.
        return {
            "v": PROTOCOL_VERSION,
            "type": self.type,
            **{name: getattr(self, name) for name in FLOW_REPORT_FIELDS},
        }


FLOW_REPORT_FIELDS = tuple(f.name for f in fields(FlowReport))  # besides "v" and "type"


def flow_report(
    *,
    agent_clock: str,
    process_start_id: str,
    uptime_seconds: float,
    window_seconds: int,
    windows: list[dict[str, Any]],
    gaps: list[dict[str, Any]],
) -> dict[str, Any]:
    """A flow report's body as a JSON object (FlowReport)."""
    return FlowReport(
        agent_clock=agent_clock,
        process_start_id=process_start_id,
        uptime_seconds=uptime_seconds,
        window_seconds=window_seconds,
        windows=windows,
        gaps=gaps,
    ).to_dict()

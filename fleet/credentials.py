"""Agent credentials: the control plane's signing key, issuing and renewing credentials, and the
credential state machine of the spec ("Credential state"), computed from stored instants (no timers).

| from                       | moved by                  | condition              | to             |
|----------------------------|---------------------------|------------------------|----------------|
| renews                     | renewal attempt fails     |                        | renewal-failed |
| renewal-failed             | renewal attempt succeeds  |                        | renews         |
| renews or renewal-failed   | passing of expiry         | expiry reached         | expired        |
| expired                    | renewal                   | within the grace       | renews (+ last_late_renewal) |
| expired                    | renewal                   | beyond the grace       | refused: re-enrol |

Apart from that table, the operator may revoke a credential (`credential_revoke`): from then on every
stream, renewal, flow report and key-signed re-enrolment of the workload is refused, whatever the
state, until a re-enrolment with a provisioning token minted for the workload.

Expiry moves no row: serve's housekeeping notices the credentials that expired since its last round
(`credential_expiries_notice`) and records `workload.credential_expired` for each.

The credential format (compact JSON, Ed25519) lives in agent/credential.py so the agent checks it
with the same code. The gateway authenticates the agent's key itself; these functions only keep the
state and sign.
"""

from __future__ import annotations

import functools
import logging
import os
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q

from agent.credential import (
    CredentialError,
    credential_payload,
    credential_sign,
    public_key_encode,
    public_key_fingerprint,
)
from agent.credential import credential_verify as _verify_with
from controlplane import clock
from controlplane.audit import audit_record
from controlplane.auth.actor import Actor
from controlplane.problems import Problem
from controlplane.text import visible
from controlplane.validation import Findings, reject_unknown, require_object, take_string
from controlplane.webhooks.models import WebhookWatermark
from controlplane.webhooks.outbox import webhook_events_record, workload_event
from fleet.models import Workload
from fleet.push import notify_streams
from fleet.selectors import workload_get

log = logging.getLogger("palisade.credentials")

SIGNING_KEY_FILE = "agent-signing-key.pem"
# Every serve process listens on this PostgreSQL channel (controlplane/credential_watch.py).
CREDENTIAL_CHANGES_CHANNEL = "palisade_credential_changes"
RENEWS, RENEWAL_FAILED, EXPIRED = "renews", "renewal-failed", "expired"
MAX_ERROR_LENGTH = 2000

_key_cache: dict[str, tuple[tuple[int, int], Ed25519PrivateKey]] = {}


# --- the signing key -------------------------------------------------------------------------------


def signing_key_path() -> Path:
    return Path(settings.DATA_DIR) / SIGNING_KEY_FILE


def signing_key() -> Ed25519PrivateKey:
    """The control plane's Ed25519 key: `agent-signing-key.pem` in the data directory, made on first
    use (mode 0600) and reused afterwards. Every credential any agent holds is signed with it, so
    deleting it forces every workload to re-enrol; several `serve` processes must share one."""
    path = signing_key_path()
    try:
        stat = path.stat()
    except FileNotFoundError:
        _generate_signing_key(path)
        stat = path.stat()
    identity = (stat.st_ino, stat.st_mtime_ns)
    cached = _key_cache.get(str(path))
    if cached and cached[0] == identity:
        return cached[1]
    key = _load_signing_key(path)
    if stat.st_mode & 0o077:
        log.warning(
            "the agent signing key %s is readable by other users (mode %o)", path, stat.st_mode & 0o777
        )
    _key_cache[str(path)] = (identity, key)
    return key


def _load_signing_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError, serialization.UnsupportedAlgorithm):
        raise RuntimeError(f"the agent signing key {path} is not an unencrypted PEM Ed25519 key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise RuntimeError(f"the agent signing key {path} is not an Ed25519 key")
    return key


def _generate_signing_key(path: Path) -> None:
    """Write a new key to a private temporary file, then link it into place: two processes racing on
    first use end up with the one key that won the link, and nobody ever reads a half-written file."""
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(pem)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
            log.info("generated the agent signing key %s", path)
        except FileExistsError:
            pass  # another process made it first: use theirs
    finally:
        tmp.unlink(missing_ok=True)


def signing_public_key() -> str:
    """The public half of the signing key, standard base64 of the raw 32 bytes: agents verify their
    credentials with it."""
    return public_key_encode(signing_key().public_key())


# --- lifetimes and state ---------------------------------------------------------------------------


def credential_lifetime() -> timedelta:
    return timedelta(seconds=settings.PALISADE_CREDENTIAL_LIFETIME_SECONDS)


def credential_grace() -> timedelta:
    return timedelta(seconds=settings.PALISADE_CREDENTIAL_GRACE_SECONDS)


def credential_renewal_due_at(workload: Workload) -> datetime:
    """Renewal is due once two thirds of the credential's own lifetime have passed."""
    span = workload.credential_expires_at - workload.credential_issued_at
    return workload.credential_issued_at + span * 2 / 3


def credential_grace_ends_at(workload: Workload) -> datetime:
    return workload.credential_expires_at + credential_grace()


def credential_state(workload: Workload, now: datetime | None = None) -> str:
    """`renews`, `renewal-failed` or `expired` (spec "Credential state")."""
    now = now or clock.now()
    if now >= workload.credential_expires_at:
        return EXPIRED
    return RENEWAL_FAILED if workload.credential_renewal_failed else RENEWS


def credential_state_filters(now: datetime) -> dict[str, Q]:
    """credential_state as database filters, one per state (the fleet's counts; a test keeps the two
    equal, tests/controlplane/test_metrics_collector.py)."""
    valid = Q(credential_expires_at__gt=now)
    return {
        RENEWS: valid & Q(credential_renewal_failed=False),
        RENEWAL_FAILED: valid & Q(credential_renewal_failed=True),
        EXPIRED: ~valid,
    }


def credential_beyond_grace_filter(now: datetime) -> Q:
    """credential_beyond_grace as a database filter."""
    return Q(credential_expires_at__lte=now - credential_grace())


def credential_start(workload: Workload, *, now: datetime, serial: int) -> None:
    """Give the (unsaved) workload a fresh credential's fields: serial, issued now, full lifetime."""
    workload.credential_serial = serial
    workload.credential_issued_at = now
    workload.credential_expires_at = now + credential_lifetime()
    workload.credential_renewal_failed = False
    workload.credential_last_error = ""


CREDENTIAL_FIELDS = [
    "credential_serial",
    "credential_issued_at",
    "credential_expires_at",
    "credential_renewal_failed",
    "credential_last_error",
]


# --- issuing and verifying -------------------------------------------------------------------------


@dataclass(frozen=True)
class SignedCredential:
    text: str  # what the agent keeps and presents; format in agent/credential.py
    workload_id: str
    serial: int
    issued_at: datetime
    expires_at: datetime
    renewal_due_at: datetime


def credential_issue(*, workload: Workload) -> SignedCredential:
    """Sign the credential the workload's row describes (its id, public key, serial and instants)."""
    payload = credential_payload(
        workload_id=str(workload.id),
        public_key=workload.public_key,
        serial=workload.credential_serial,
        issued_at=workload.credential_issued_at,
        expires_at=workload.credential_expires_at,
    )
    return SignedCredential(
        text=credential_sign(payload, signing_key()),
        workload_id=str(workload.id),
        serial=workload.credential_serial,
        issued_at=workload.credential_issued_at,
        expires_at=workload.credential_expires_at,
        renewal_due_at=credential_renewal_due_at(workload),
    )


def credential_verify(text: str) -> dict[str, Any]:
    """The payload of a credential this control plane signed; `unauthenticated` when it is malformed
    or its signature does not verify. Neither expiry nor whether it is the workload's current serial
    is checked here: the caller compares the payload with the workload's row."""
    try:
        if not isinstance(text, str):  # not one we signed, and not a cache key
            return _verify_with(text, signing_key().public_key())
        return dict(_verified_payload(text, signing_key()))
    except CredentialError as error:
        raise Problem("unauthenticated", f"The credential is refused: {error}.") from None


# Every flow report carries its workload's credential, the same text until it renews: verifying the
# signature once per text saves an Ed25519 verification per report. Only credentials that verified are
# kept (a failure raises, which the cache does not keep), under the key object that signed them, so a
# new signing key verifies afresh. Sized for a fleet of 10,000 with room: about 1.5 KB an entry.
@functools.lru_cache(maxsize=16384)
def _verified_payload(text: str, key: Ed25519PrivateKey) -> dict[str, Any]:
    return _verify_with(text, key.public_key())


def credential_names(credential: str, *, workload_id: uuid.UUID, public_key: str, serial: int) -> bool:
    """Whether `credential` is one this control plane signed for the workload, its key and serial: what
    a stream's `auth` (fleet/streams.py) and a flow report's headers (fleet/report_auth.py) must show."""
    try:
        payload = credential_verify(credential)
    except Problem:
        return False
    return (
        payload.get("workload_id") == str(workload_id)
        and payload.get("public_key") == public_key
        and payload.get("serial") == serial
    )


def credential_change_announce(workload_id: uuid.UUID | str) -> None:
    """Tell every serve process, when the current transaction commits, that the workload's credential
    changed (revoked, renewed, re-enrolled): the flow report headers each passed for it are checked in
    the database again from its next report on (controlplane/credential_watch.py). Nothing to tell on
    SQLite, where serve checks every report's headers in the database."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [CREDENTIAL_CHANGES_CHANNEL, str(workload_id)])


def workload_key(workload_id: str) -> uuid.UUID | None:
    """The workload id an agent presents, as the workload's key; None when it is not one."""
    try:
        return uuid.UUID(workload_id)
    except ValueError:
        return None


# --- renewal ---------------------------------------------------------------------------------------


class CredentialRevoked(Problem):
    """A renewal (or stream, or report) of a workload whose credential the operator revoked: the
    stream closes with 4410 and only a re-enrolment with a token minted for the workload helps."""

    def __init__(self, workload: Workload):
        super().__init__("credential-revoked", credential_revoked_detail(workload))


def revocation_reason_text(workload: Workload) -> str:
    reason = workload.credential_revoked_reason
    return f" ({reason})" if reason else ""


def credential_revoked_detail(workload: Workload) -> str:
    return (
        f"The credential of workload {workload.id} was revoked at "
        f"{clock.rfc3339(workload.credential_revoked_at)}{revocation_reason_text(workload)}: re-enrol it "
        "with a provisioning token minted for it."
    )


class CredentialBeyondGrace(Problem):
    """The one renewal refusal after which only a new enrolment helps (the stream closes with 4403).
    Every other failure of a renewal is the control plane's and the agent retries it."""

    def __init__(self, detail: str):
        super().__init__("unauthenticated", detail)


def credential_beyond_grace(workload: Workload, now: datetime) -> bool:
    return now >= credential_grace_ends_at(workload)


def credential_renew(*, workload_id: str, now: datetime | None = None) -> SignedCredential:
    """A new credential for the workload (next serial, a full lifetime from now). Admitted while the
    credential is valid and up to the grace after its expiry; a renewal made with an expired
    credential sets `credential_last_late_renewal`. Beyond the grace it is refused: re-enrol."""
    with transaction.atomic():
        workload = workload_get(workload_id=workload_id, for_update=True)
        now = now or clock.now()
        if workload.credential_revoked_at is not None:
            raise CredentialRevoked(workload)
        if credential_beyond_grace(workload, now):
            raise CredentialBeyondGrace(
                f"The credential of workload {workload.id} expired at "
                f"{clock.rfc3339(workload.credential_expires_at)}, "
                f"more than the renewal grace ({_duration(credential_grace())}) ago; it cannot be renewed: "
                "re-enrol the workload with a provisioning token minted for it.",
            )
        # A renewal is contact, also over a renew-only stream (an expired credential's only message).
        workload.last_heard_from = now
        fields = [*CREDENTIAL_FIELDS, "last_heard_from"]
        if now >= workload.credential_expires_at:
            workload.credential_last_late_renewal = now
            workload.credential_last_late_by_seconds = int(
                (now - workload.credential_expires_at).total_seconds()
            )
            fields += ["credential_last_late_renewal", "credential_last_late_by_seconds"]
        credential_start(workload, now=now, serial=workload.credential_serial + 1)
        workload.save(update_fields=fields)
        credential_change_announce(workload.id)
        return credential_issue(workload=workload)


MAX_REVOCATION_REASON = 1000


def credential_revoke(*, actor: Actor, workload_id: str, data: Any = None) -> Workload:
    """Revoke the workload's credential (`data`: optional {"reason"}): its open stream closes (4410),
    and from now on its streams, renewals, flow reports and key-signed re-enrolments are refused. The
    workload stays in the fleet (nothing is deleted) and shows the revocation; a re-enrolment with a
    provisioning token minted for it is the only way back. Revoking again is harmless and keeps the
    first instant and reason."""
    data = require_object({} if data is None else data)
    findings = Findings()
    reject_unknown(data, {"reason"}, findings)
    reason = take_string(data, "reason", findings, required=False, max_length=MAX_REVOCATION_REASON)
    findings.raise_if_any()
    with transaction.atomic():
        workload = workload_get(workload_id=workload_id, for_update=True)
        if workload.credential_revoked_at is None:
            workload.credential_revoked_at = clock.now()
            workload.credential_revoked_reason = reason.strip()
            workload.save(update_fields=["credential_revoked_at", "credential_revoked_reason"])
            audit_record(
                actor=actor,
                action="workload.revoke_credential",
                object_type="workload",
                object_id=workload.id,
                object_name=workload.hostname,
                detail={
                    "reason": workload.credential_revoked_reason,
                    "credential_serial": workload.credential_serial,
                    "public_key_fingerprint": public_key_fingerprint(workload.public_key),
                },
            )
        # Sent every time: a stream that somehow survived the first notice is told again. serve's
        # catch-up sweep also closes the stream of a revoked workload, for a host command without Redis.
        notify_streams([str(workload.id)], {"type": "credential.revoked"})
        credential_change_announce(workload.id)
    return workload


def credential_renewal_failed(*, workload_id: str, error: str) -> Workload:
    """Record a failed renewal attempt: `renews` becomes `renewal-failed`; the error stays on the
    workload until a renewal succeeds."""
    with transaction.atomic():
        workload = workload_get(workload_id=workload_id, for_update=True)
        if not workload.credential_renewal_failed:  # once per failing spell, not per retry
            webhook_events_record([_renewal_failed_event(workload, error)])
        workload.credential_renewal_failed = True
        # Often the agent's own text (renewal_failed): escaped, as every agent's free text is stored.
        workload.credential_last_error = visible(error or "renewal failed", keep="\n\t")[:MAX_ERROR_LENGTH]
        workload.save(update_fields=["credential_renewal_failed", "credential_last_error"])
    return workload


def _renewal_failed_event(workload: Workload, error: str):
    return workload_event(
        "workload.credential_renewal_failed",
        workload,
        error=visible(error or "renewal failed", keep="\n\t")[:MAX_ERROR_LENGTH],
        credential_serial=workload.credential_serial,
        expires_at=clock.rfc3339(workload.credential_expires_at),
    )


def _duration(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    if seconds % 3600 == 0:
        return f"{seconds // 3600} h"
    if seconds % 60 == 0:
        return f"{seconds // 60} min"
    return f"{seconds} s"


CREDENTIAL_EXPIRY = "credential-expiry"


def credential_expiries_notice(*, now: datetime | None = None) -> int:
    """Record `workload.credential_expired` once for each credential that expired since the last
    round. The watermark row is locked for the round, so several serve processes notice each expiry
    once; it starts at the first round (credentials that expired before webhooks existed are not news)."""
    now = now or clock.now()
    with transaction.atomic():
        mark = WebhookWatermark.objects.select_for_update().filter(name=CREDENTIAL_EXPIRY).first()
        if mark is None:
            WebhookWatermark.objects.create(name=CREDENTIAL_EXPIRY, at=now)
            return 0
        if now <= mark.at:
            return 0
        expired = list(
            Workload.objects.select_for_update()
            .filter(credential_expires_at__gt=mark.at, credential_expires_at__lte=now)
            .order_by("credential_expires_at", "id")
        )
        webhook_events_record(
            workload_event(
                "workload.credential_expired",
                workload,
                credential_serial=workload.credential_serial,
                expired_at=clock.rfc3339(workload.credential_expires_at),
                revoked=workload.credential_revoked_at is not None,
            )
            for workload in expired
        )
        mark.at = now
        mark.save(update_fields=["at"])
    return len(expired)

"""What the gateway decides about a sync stream, as domain functions (the consumer only moves frames):
who may open one, and the snapshot it sends."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import lru_cache

from django.conf import settings

from agent import protocol
from controlplane import clock
from controlplane.models import GatewayIdentity
from controlplane.problems import Problem
from fleet.credentials import credential_grace_ends_at, credential_renewal_due_at, credential_state, credential_verify
from fleet.models import RenderedPolicy, Workload
from fleet.rendering import workloads_rerender


class StreamRefused(Exception):
    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class StreamGrant:
    workload_id: str
    hostname: str
    renew_only: bool
    welcome: protocol.Welcome


def gateway_fingerprint() -> str:
    """The fingerprint of the certificate this gateway serves, which agents bind their proofs to."""
    if getattr(settings, "PALISADE_GATEWAY_FINGERPRINT", ""):
        return settings.PALISADE_GATEWAY_FINGERPRINT
    identity = GatewayIdentity.objects.filter(id=1).first()
    return identity.fingerprint if identity else ""


def stream_authenticate(*, auth: protocol.Auth, nonce: bytes) -> StreamGrant:
    """Check an `auth` message: the credential is ours, names this workload and the key it is enrolled
    with, is its current serial, and the proof signs this stream's nonce with that key. An expired
    credential within its grace may only renew; beyond it the workload must re-enrol."""
    try:
        workload_key = uuid.UUID(auth.workload_id)
    except ValueError:
        raise StreamRefused(protocol.CLOSE_UNAUTHENTICATED, "unknown workload") from None
    workload = Workload.objects.filter(id=workload_key).first()
    if workload is None:
        raise StreamRefused(protocol.CLOSE_UNAUTHENTICATED, "unknown workload")
    try:
        payload = credential_verify(auth.credential)
    except Problem:
        raise StreamRefused(protocol.CLOSE_UNAUTHENTICATED, "credential refused") from None
    if (
        payload.get("workload_id") != str(workload.id)
        or payload.get("public_key") != workload.public_key
        or payload.get("serial") != workload.credential_serial
    ):
        raise StreamRefused(protocol.CLOSE_UNAUTHENTICATED, "credential is not the workload's current one")
    fingerprint = gateway_fingerprint()
    if not protocol.verify_proof(
        workload.public_key, auth.proof, nonce=nonce, workload_id=str(workload.id), gateway_fingerprint=fingerprint
    ):
        raise StreamRefused(protocol.CLOSE_UNAUTHENTICATED, "proof of possession failed")
    now = clock.now()
    if now >= credential_grace_ends_at(workload):
        raise StreamRefused(protocol.CLOSE_FORBIDDEN, "credential expired beyond its grace: re-enrol")
    state = credential_state(workload, now)
    welcome = protocol.Welcome(
        workload_id=str(workload.id),
        credential_state=state,
        expires_at=clock.rfc3339(workload.credential_expires_at),
        renewal_due_at=clock.rfc3339(credential_renewal_due_at(workload)),
        renew_only=state == "expired",
    )
    return StreamGrant(workload_id=str(workload.id), hostname=workload.hostname, renew_only=state == "expired", welcome=welcome)


@lru_cache(maxsize=256)
def _rendered(version: str) -> tuple[str, dict]:
    # A version is the hash of its document: what it names never changes, so every stream of this
    # process can share one copy instead of reading ~100 KB from the database per snapshot.
    policy = RenderedPolicy.objects.get(version=version)
    return policy.document, policy.rule_index


def stream_snapshot(*, workload_id: str) -> protocol.Snapshot:
    """The workload's latest rendered policy, rendering it first if it has none yet."""
    row = Workload.objects.filter(id=workload_id).values("latest_policy_id", "mode").get()
    if row["latest_policy_id"] is None:
        workloads_rerender(workload_ids=[workload_id])
        row = Workload.objects.filter(id=workload_id).values("latest_policy_id", "mode").get()
    document, rule_index = _rendered(row["latest_policy_id"])
    return protocol.Snapshot(version=row["latest_policy_id"], mode=row["mode"], document=document, rule_index=dict(rule_index))

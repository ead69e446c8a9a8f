"""Provisioning tokens: minted by the operator, consumed by agents at enrolment.

A token is a random secret `pal_pt_...`; only its SHA-256 digest is stored, and lists show its first
characters (`prefix`). The secret is shown once, inside the enrolment bundle (agent/bundle.py) that
also tells the agent where the gateway is and which certificate to pin. A token may carry labels
(given to every workload it enrols), an expiry and a maximum number of uses; a revoked, expired or
used-up token enrols nothing.

A general token creates new workloads and re-enrols none. A token minted for a workload (its
`workload_id`) is the operator's consent to re-enrol that one workload, once: it carries no labels
and creates nothing (fleet/enrolment.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction

# bundle_decode is re-exported for callers on the control plane's side.
from agent.bundle import PROVISIONING_TOKEN_PREFIX, BundleError, bundle_decode, bundle_encode  # noqa: F401
from controlplane import clock
from controlplane.audit import audit_record
from controlplane.auth.actor import Actor
from controlplane.auth.secrets import digest, display_prefix, new_secret
from controlplane.auth.services import token_revoke
from controlplane.lookups import get_or_not_found
from controlplane.pagination import OrderKey, Page, list_fingerprint, paginate
from controlplane.problems import Problem, pointer
from controlplane.validation import (
    Findings,
    quoted,
    reject_unknown,
    require_object,
    take_instant,
    take_int,
    take_string,
)
from fleet.models import ProvisioningToken, Workload
from policy.grammar import validate_labels

MAX_DESCRIPTION = 1000
MAX_LABELS = 64  # as many as a workload may carry
MAX_USES = 2**31 - 1
PROVISIONING_TOKEN_ORDER = (OrderKey("created_at"), OrderKey("id", read=lambda t: str(t.id)))

ACTIVE, REVOKED, EXPIRED, USED_UP = "active", "revoked", "expired", "used-up"


@dataclass(frozen=True)
class ProvisioningTokenInput:
    description: str
    expires_at: datetime | None
    max_uses: int | None
    labels: dict[str, str]
    workload_id: str | None = None


@dataclass(frozen=True)
class MintedProvisioningToken:
    secret: str  # shown once
    token: ProvisioningToken
    bundle: str  # palisade-enrol-v1:..., holds the secret; shown once


def provisioning_token_input(data: Any) -> ProvisioningTokenInput:
    data = require_object(data)
    findings = Findings()
    reject_unknown(data, {"description", "expires_at", "max_uses", "labels", "workload_id"}, findings)
    description = take_string(data, "description", findings, min_length=1, max_length=MAX_DESCRIPTION)
    if description and not description.strip():
        findings.add("/description", "too-short", "description must not be blank.")
    expires_at = take_instant(data, "expires_at", findings)
    if expires_at is not None and expires_at <= clock.now():
        findings.add("/expires_at", "in-the-past", "expires_at must be in the future.")
    max_uses = take_int(data, "max_uses", findings, minimum=1, maximum=MAX_USES)
    labels = data.get("labels")
    if labels is None:
        labels = {}
    else:
        for key, error in validate_labels(labels):
            where = "/labels" if error.rule == "labels-type" else pointer("labels", key)
            findings.add(where, error.rule, error.message)
        if isinstance(labels, Mapping) and len(labels) > MAX_LABELS:
            findings.add("/labels", "too-many", f"A token may carry at most {MAX_LABELS} labels.")
    workload_id = _workload_id_input(data, findings)
    if workload_id is not None:
        # The operator's consent to re-enrol that one workload, once: it keeps its own labels.
        if max_uses not in (None, 1):
            findings.add("/max_uses", "workload-token", "A token minted for a workload has exactly one use.")
        if labels:
            findings.add(
                "/labels",
                "workload-token",
                "A token minted for a workload carries no labels: it keeps its own.",
            )
        max_uses = 1
    findings.raise_if_any()
    return ProvisioningTokenInput(
        description=description.strip(),
        expires_at=expires_at,
        max_uses=max_uses,
        labels=dict(labels),
        workload_id=workload_id,
    )


def _workload_id_input(data: Mapping[str, Any], findings: Findings) -> str | None:
    raw = data.get("workload_id")
    if raw is None:
        return None
    try:
        workload_id = str(uuid.UUID(raw)) if isinstance(raw, str) else None
    except ValueError:
        workload_id = None
    if workload_id is None or not Workload.objects.filter(id=workload_id).exists():
        findings.add(
            "/workload_id", "workload", f"No workload {quoted(raw)}: workload_id names an enrolled workload."
        )
        return None
    return workload_id


def provisioning_token_state(token: ProvisioningToken, now: datetime | None = None) -> str:
    """`active`, or why the token enrols nothing: `revoked`, `expired` or `used-up`."""
    now = now or clock.now()
    if token.revoked_at is not None:
        return REVOKED
    if token.expires_at is not None and token.expires_at <= now:
        return EXPIRED
    if token.max_uses is not None and token.uses >= token.max_uses:
        return USED_UP
    return ACTIVE


def gateway_identity() -> tuple[tuple[str, ...], str]:
    """(addresses, certificate fingerprint) a bundle carries."""
    from controlplane import tls
    from controlplane.service_identity import gateway_identity as identity

    try:
        found = identity(certificate_if_unrecorded=True)
    except tls.CertificateError as error:
        raise Problem("internal", f"Cannot read the gateway certificate: {error}.") from None
    return found.addresses, found.fingerprint


def enrolment_bundle(secret: str) -> str:
    addresses, fingerprint = gateway_identity()
    try:
        return bundle_encode(gateways=list(addresses), fingerprint=fingerprint, token=secret)
    except BundleError as error:
        # e.g. an advertised address without a port: no agent could use such a bundle.
        raise Problem(
            "internal", f"Cannot make an enrolment bundle: {error}; check --gateway-advertise."
        ) from None


def provisioning_token_mint(*, actor: Actor, data: Mapping[str, Any]) -> MintedProvisioningToken:
    spec = provisioning_token_input(data)
    secret = new_secret(PROVISIONING_TOKEN_PREFIX)
    bundle = enrolment_bundle(secret)  # before the write: a token nobody can be given is never stored
    with transaction.atomic():
        token = ProvisioningToken.objects.create(
            description=spec.description,
            prefix=display_prefix(secret),
            digest=digest(secret),
            labels=spec.labels,
            created_at=clock.now(),
            expires_at=spec.expires_at,
            max_uses=spec.max_uses,
            workload_id=spec.workload_id,
        )
        audit_record(
            actor=actor,
            action="provisioning_token.create",
            object_type="provisioning_token",
            object_id=token.id,
            object_name=token.description[:300],
            detail={
                "prefix": token.prefix,
                "labels": token.labels,
                "max_uses": token.max_uses,
                "expires_at": clock.rfc3339(token.expires_at),
                "workload_id": spec.workload_id,
            },
        )
    return MintedProvisioningToken(secret=secret, token=token, bundle=bundle)


def provisioning_token_revoke(*, actor: Actor, token_id: str) -> ProvisioningToken:
    """Revoke a token: it enrols nothing from now on. Workloads it enrolled stay."""
    return token_revoke(
        ProvisioningToken,
        actor=actor,
        token_id=token_id,
        what="provisioning token",
        name=lambda token: token.description[:300],
    )


def provisioning_token_get(*, token_id: str) -> ProvisioningToken:
    return get_or_not_found(ProvisioningToken, token_id, what="provisioning token")


def provisioning_token_list(*, cursor: str | None, limit: int) -> Page:
    return paginate(
        ProvisioningToken.objects.all(),
        order=PROVISIONING_TOKEN_ORDER,
        cursor=cursor,
        limit=limit,
        fingerprint=list_fingerprint("provisioning-tokens", {}),
    )


def provisioning_token_check(*, secret: str) -> ProvisioningToken:
    """The token an enrolment presents, if it can still be used: `unauthenticated` when it is not a
    token, unknown, revoked, expired or used up. Reads without locking; the use is taken by
    `provisioning_token_consume` at the end of the enrolment."""
    return _usable(_token_of(secret, lock=False))


def provisioning_token_consume(*, secret: str) -> ProvisioningToken:
    """Use the token once, refusing like `provisioning_token_check`. The row stays locked until the
    caller's transaction ends, so of concurrent enrolments with a token that has one use left exactly
    one gets it; call it last inside the enrolment's transaction, so the lock is held only while it
    commits (enrolments with one token would otherwise queue behind each other's rendering) and a
    failed enrolment gives the use back."""
    with transaction.atomic():
        token = _usable(_token_of(secret, lock=True))
        token.uses += 1
        token.last_used_at = clock.now()
        token.save(update_fields=["uses", "last_used_at"])
    return token


def _token_of(secret: str, *, lock: bool) -> ProvisioningToken:
    if not isinstance(secret, str) or not secret.startswith(PROVISIONING_TOKEN_PREFIX):
        raise Problem(
            "unauthenticated",
            f"That is not a provisioning token (they start with {PROVISIONING_TOKEN_PREFIX}).",
        )
    tokens = ProvisioningToken.objects
    # NO KEY UPDATE: the workloads enrolled in this transaction reference the token (a key-share lock
    # each), which a plain FOR UPDATE would wait for across concurrent enrolments.
    token = (tokens.select_for_update(no_key=True) if lock else tokens).filter(digest=digest(secret)).first()
    if token is None:
        raise Problem("unauthenticated", "The provisioning token is not known to this control plane.")
    return token


def _usable(token: ProvisioningToken) -> ProvisioningToken:
    state = provisioning_token_state(token, clock.now())
    name = f"The provisioning token {token.prefix}"
    if state == REVOKED:
        raise Problem("unauthenticated", f"{name} was revoked at {clock.rfc3339(token.revoked_at)}.")
    if state == EXPIRED:
        raise Problem("unauthenticated", f"{name} expired at {clock.rfc3339(token.expires_at)}.")
    if state == USED_UP:
        raise Problem(
            "unauthenticated", f"{name} is used up: it was used {token.uses} of {token.max_uses} times."
        )
    return token

"""Enrolment: an agent presents a provisioning token and its public key; the control plane creates
the workload (or re-enrols an existing one) and returns its first credential.

The whole enrolment is one transaction: the token's use, the workload and its rendered policy commit
together, or not at all (a refused enrolment gives the token's use back).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction

from agent import protocol
from agent.credential import CredentialError, public_key_decode, public_key_encode, public_key_fingerprint
from controlplane import clock
from controlplane.addresses import WHAT_IT_NAMES, kind_phrase, plain, special_use
from controlplane.audit import audit_record
from controlplane.auth.actor import Actor
from controlplane.problems import Problem, pointer
from controlplane.service_identity import gateway_identity
from controlplane.text import has_unsafe
from controlplane.validation import Findings, parse_instant, quoted
from fleet.choices import Mode, SyncState
from fleet.credentials import (
    CREDENTIAL_FIELDS,
    SignedCredential,
    credential_beyond_grace,
    credential_change_announce,
    credential_issue,
    credential_start,
    revocation_reason_text,
)
from fleet.models import ProvisioningToken, Workload
from fleet.provisioning import provisioning_token_check, provisioning_token_consume
from fleet.push import notify_streams
from fleet.rendering import rerender_for_peer_change
from fleet.selectors import workload_get, workloads_holding

MAX_HOSTNAME = 255
MAX_ADDRESSES = 64
MAX_AGENT_VERSION = 64
# DNS-ish: dot-separated labels of letters, digits, '-' and '_', each 1-63 long and not starting or
# ending with '-'; one trailing dot allowed (dropped).
_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


@dataclass(frozen=True)
class Enrolled:
    workload: Workload
    credential: SignedCredential
    re_enrolled: bool = False


@dataclass(frozen=True)
class EnrolmentInput:
    public_key: str  # canonical base64
    hostname: str
    addresses: list[str]
    agent_version: str


def _hostname_input(hostname: Any, findings: Findings) -> str:
    if not isinstance(hostname, str):
        findings.add(
            "/hostname", "type" if hostname is not None else "required", "hostname must be a string."
        )
        return ""
    if not hostname:
        findings.add("/hostname", "too-short", "hostname must not be empty.")
        return ""
    if len(hostname) > MAX_HOSTNAME:
        findings.add("/hostname", "too-long", f"hostname must have at most {MAX_HOSTNAME} characters.")
        return ""
    name = hostname[:-1] if hostname.endswith(".") and len(hostname) > 1 else hostname
    if not all(_HOST_LABEL.fullmatch(part) for part in name.split(".")):
        findings.add(
            "/hostname",
            "hostname",
            f"{quoted(hostname)} is not a host name: dot-separated parts of letters, digits, '-' and '_', "
            "each 1-63 characters, not starting or ending with '-'.",
        )
        return ""
    return name


def _addresses_input(addresses: Any, findings: Findings) -> list[str]:
    if not isinstance(addresses, (list, tuple)):
        findings.add("/addresses", "type", "addresses must be a list of IP addresses.")
        return []
    if len(addresses) > MAX_ADDRESSES:
        findings.add("/addresses", "too-many", f"addresses may have at most {MAX_ADDRESSES} items.")
        return []
    normalised: list[str] = []
    for index, item in enumerate(addresses):
        path = pointer("addresses", index)
        if not isinstance(item, str):
            findings.add(path, "type", "An address must be a string: an IPv4 or IPv6 address.")
            continue
        try:
            address = ipaddress.ip_address(item.strip())
        except ValueError:
            findings.add(
                path, "address", f"{quoted(item)} is not an IPv4 or IPv6 address (no prefix length)."
            )
            continue
        if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
            findings.add(
                path,
                "address",
                f"{quoted(item)} carries a zone (%{address.scope_id}); give the address alone.",
            )
            continue
        address = plain(address)
        kind = special_use(address)
        if kind is not None:
            findings.add(
                path,
                f"address-{kind}",
                f"{quoted(item)} is {kind_phrase(kind)}: it names {WHAT_IT_NAMES[kind]}, not this workload, "
                "and other workloads' rules would admit it as this workload. Give the host's own addresses.",
            )
            continue
        normalised.append(str(address))
    return list(dict.fromkeys(normalised))


def enrolment_input(
    *,
    public_key: Any,
    hostname: Any,
    addresses: Any,
    agent_version: Any,
    findings: Findings | None = None,
) -> EnrolmentInput:
    """Check what an agent sends at enrolment; one finding per field to fix (paths as in the
    enrolment request body: /public_key, /hostname, /addresses/0, /agent_version), with any
    `findings` the caller made already."""
    findings = findings if findings is not None else Findings()
    canonical_key = ""
    try:
        canonical_key = public_key_encode(public_key_decode(public_key))
    except CredentialError as error:
        message = str(error)
        findings.add("/public_key", "public-key", f"{message[:1].upper()}{message[1:]}.")
    name = _hostname_input(hostname, findings)
    normalised = _addresses_input(addresses, findings)
    if agent_version is None:
        agent_version = ""
    if not isinstance(agent_version, str):
        findings.add("/agent_version", "type", "agent_version must be a string.")
    elif len(agent_version) > MAX_AGENT_VERSION:
        findings.add(
            "/agent_version", "too-long", f"agent_version must have at most {MAX_AGENT_VERSION} characters."
        )
    elif has_unsafe(agent_version):
        findings.add(
            "/agent_version",
            "control-characters",
            "agent_version must not contain control or format characters (ESC, CR, bidi overrides, ...).",
        )
    findings.raise_if_any()
    return EnrolmentInput(
        public_key=canonical_key, hostname=name, addresses=normalised, agent_version=agent_version
    )


def workload_enrol(
    *,
    token_secret: str,
    public_key: str,
    hostname: str,
    addresses: list[str],
    agent_version: str,
    workload_id: str | None = None,
    key_proof: Any = None,
) -> Enrolled:
    """Enrol a workload.

    New (no `workload_id`), with a general provisioning token: mode `visibility`, sync state `offline`
    and never connected, the token's labels, and a fresh credential (serial 1). A token minted for a
    workload creates nothing (`enrolment-refused`).

    Re-enrolment (`workload_id` of an existing workload, e.g. a reinstalled host) needs the operator's
    consent for that one workload: a provisioning token minted for it, or a `key_proof` signed with
    the workload's current key (the agent rotating its own key; refused once the credential is
    revoked or beyond its grace). A general token re-enrols nothing: workload ids are not secret.
    It keeps the id, labels, mode and history; takes the new public key, host name, addresses and
    agent version; issues a new credential (next serial), clears any renewal failure and, with a
    token, a revocation. Each enrolment is an audit event."""
    given = {
        "token_secret": token_secret,
        "public_key": public_key,
        "hostname": hostname,
        "addresses": addresses,
        "agent_version": agent_version,
        "key_proof": key_proof,
    }
    with transaction.atomic():
        if workload_id is None:
            return _enrol_new(**given)
        return _re_enrol(**given, workload_id=workload_id)


def _enrol_new(*, token_secret, public_key, hostname, addresses, agent_version, key_proof) -> Enrolled:
    """The token is checked first (`unauthenticated`, `enrolment-refused`), then the input."""
    token = provisioning_token_check(secret=token_secret)
    if token.workload_id is not None:
        raise Problem(
            "enrolment-refused",
            f"The provisioning token {token.prefix} was minted to re-enrol workload {token.workload_id} "
            "and enrols nothing else; a new workload is enrolled with a general token.",
        )
    findings = Findings()
    if key_proof is not None:
        findings.add("/key_proof", "key-proof", "key_proof re-enrols an existing workload: give workload_id.")
    spec = enrolment_input(
        public_key=public_key,
        hostname=hostname,
        addresses=addresses,
        agent_version=agent_version,
        findings=findings,
    )
    _addresses_free(spec.addresses)
    now = clock.now()
    workload = Workload(
        hostname=spec.hostname,
        addresses=spec.addresses,
        labels=dict(token.labels),
        mode=Mode.VISIBILITY,
        agent_version=spec.agent_version,
        sync_state=SyncState.OFFLINE,
        last_heard_from=None,
        rank=Workload.RANK_OFFLINE,
        public_key=spec.public_key,
        enrolled_at=now,
        enrolled_with=token,
    )
    credential_start(workload, now=now, serial=1)
    workload.save(force_insert=True)
    _render_new_workload(workload, labels_before={})
    credential = credential_issue(workload=workload)
    provisioning_token_consume(secret=token_secret)
    audit_record(
        actor=_agent_actor(token),
        action="workload.enrol",
        object_type="workload",
        object_id=workload.id,
        object_name=workload.hostname,
        detail={
            "via": "token",
            "token_id": str(token.id),
            "token_prefix": token.prefix,
            "public_key_fingerprint": public_key_fingerprint(workload.public_key),
            "hostname": workload.hostname,
            "addresses": list(workload.addresses),
            "credential_serial": workload.credential_serial,
        },
    )
    return Enrolled(workload=workload, credential=credential)


def _re_enrol(
    *, token_secret, public_key, hostname, addresses, agent_version, workload_id, key_proof
) -> Enrolled:
    """The input is checked first (`validation`), then the workload (`not-found`), then the consent
    (`unauthenticated`, `enrolment-refused`, `credential-revoked`)."""
    findings = Findings()
    proof = _key_proof_input(key_proof, findings) if key_proof is not None else None
    spec = enrolment_input(
        public_key=public_key,
        hostname=hostname,
        addresses=addresses,
        agent_version=agent_version,
        findings=findings,
    )
    workload = workload_get(
        workload_id=workload_id,
        for_update=True,
        missing=f"No workload {workload_id} to re-enrol; enrol without a workload id.",
    )
    consent = _re_enrol_consent(
        workload,
        token_secret=token_secret,
        proof=proof,
        content={"public_key": public_key, "hostname": hostname, "addresses": addresses},
    )
    _addresses_free(spec.addresses, workload_id=workload.id)
    before = {
        "public_key_fingerprint": public_key_fingerprint(workload.public_key),
        "hostname": workload.hostname,
        "addresses": list(workload.addresses),
        "credential_serial": workload.credential_serial,
    }
    revoked_at = workload.credential_revoked_at
    labels_before = dict(workload.labels)
    now = clock.now()
    workload.hostname = spec.hostname
    workload.addresses = spec.addresses
    workload.agent_version = spec.agent_version
    workload.public_key = spec.public_key
    workload.enrolled_at = now
    fields = ["hostname", "addresses", "agent_version", "public_key", "enrolled_at", *CREDENTIAL_FIELDS]
    if consent is not None:  # a token minted for it: the operator's consent, also after a revocation
        workload.enrolled_with = consent
        workload.credential_revoked_at = None
        workload.credential_revoked_reason = ""
        fields += ["enrolled_with", "credential_revoked_at", "credential_revoked_reason"]
    credential_start(workload, now=now, serial=workload.credential_serial + 1)
    workload.save(update_fields=fields)
    # A stream still open under the old key must not outlive the re-enrolment, nor its report headers.
    notify_streams([str(workload.id)], {"type": "stream.replaced", "stream_id": ""})
    credential_change_announce(workload.id)
    _render_new_workload(workload, labels_before=labels_before)
    credential = credential_issue(workload=workload)
    detail: dict[str, Any] = {"via": "token" if consent is not None else "key"}
    if consent is not None:
        provisioning_token_consume(secret=token_secret)
        detail.update(token_id=str(consent.id), token_prefix=consent.prefix)
    detail.update(
        old_public_key_fingerprint=before["public_key_fingerprint"],
        public_key_fingerprint=public_key_fingerprint(workload.public_key),
        old_hostname=before["hostname"],
        hostname=workload.hostname,
        old_addresses=before["addresses"],
        addresses=list(workload.addresses),
        old_credential_serial=before["credential_serial"],
        credential_serial=workload.credential_serial,
        cleared_revocation=clock.rfc3339(revoked_at) if consent is not None else None,
    )
    audit_record(
        actor=_agent_actor(consent, key_fingerprint=before["public_key_fingerprint"]),
        action="workload.re_enrol",
        object_type="workload",
        object_id=workload.id,
        object_name=workload.hostname,
        detail=detail,
    )
    return Enrolled(workload=workload, credential=credential, re_enrolled=True)


# The advisory lock of an address an enrolment claims (PostgreSQL): the prefix keeps it apart from
# other users of advisory locks (controlplane/database.py's migration lock).
ADDRESS_LOCK_PREFIX = "palisade-workload-address:"


def _addresses_free(addresses: list[str], *, workload_id: Any = None) -> None:
    """Refuse (409 `address-taken`) addresses another active workload holds: other workloads' rules
    admit an address as the workload holding it, so two workloads holding one would let either speak
    as the other. A revoked workload holds nothing; a re-enrolment replaces its workload's addresses.

    On PostgreSQL, enrolments claiming one address take turns (a transaction-scoped advisory lock per
    address, taken in order), so two of them cannot both find it free; SQLite has one writer at a time."""
    if not addresses:
        return
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            for address in sorted(addresses):
                cursor.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [ADDRESS_LOCK_PREFIX + address]
                )
    held = workloads_holding(addresses=addresses, excluding=workload_id)
    if not held:
        return
    address, holder = next(iter(held.items()))
    more = f" (and {len(held) - 1} more of its addresses are held too)" if len(held) > 1 else ""
    raise Problem(
        "address-taken",
        f"The address {address} is held by workload {holder.id} ({holder.hostname}), which is enrolled "
        f"and not revoked{more}: an address belongs to one workload. Revoke that workload's credential, or "
        "re-enrol it without the address, first; or enrol this host without it.",
        held_by=[
            {"address": address, "workload_id": str(w.id), "hostname": w.hostname}
            for address, w in held.items()
        ],
    )


def _agent_actor(token: ProvisioningToken | None, *, key_fingerprint: str = "") -> Actor:
    if token is not None:
        return Actor(kind="agent", label=f"agent with provisioning token {token.prefix}", token_id=None)
    return Actor(kind="agent", label=f"agent with the workload's key {key_fingerprint[:23]}")


@dataclass(frozen=True)
class KeyProof:
    serial: int
    signed_at: str
    signature: str


def _key_proof_input(data: Any, findings: Findings) -> KeyProof | None:
    if not isinstance(data, dict):
        findings.add("/key_proof", "type", "key_proof must be an object: serial, signed_at, signature.")
        return None
    unknown = sorted(set(data) - {"serial", "signed_at", "signature"})
    if unknown:
        findings.add(
            pointer("key_proof", unknown[0]),
            "unknown-field",
            f"Unknown field {quoted(unknown[0])} of key_proof.",
        )
    serial, signed_at, signature = data.get("serial"), data.get("signed_at"), data.get("signature")
    if isinstance(serial, bool) or not isinstance(serial, int) or serial < 1:
        findings.add(
            "/key_proof/serial", "type", "serial must be the positive serial of the current credential."
        )
    if not isinstance(signed_at, str) or parse_instant(signed_at) is None:
        findings.add(
            "/key_proof/signed_at", "instant", "signed_at must be an RFC 3339 instant with an offset."
        )
    if not isinstance(signature, str) or not signature:
        findings.add("/key_proof/signature", "type", "signature must be base64 text.")
    if findings:
        return None
    return KeyProof(serial=serial, signed_at=signed_at, signature=signature)


def _re_enrol_consent(
    workload: Workload, *, token_secret: str, proof: KeyProof | None, content: dict[str, Any]
) -> ProvisioningToken | None:
    """The token minted for this workload that admits the re-enrolment, or None when the key proof
    does; refused (with why) when neither does. A valid key proof is preferred and uses no token."""
    key_refusal: Problem | None = None
    if proof is not None:
        try:
            _key_proof_check(workload, proof, content)
            return None
        except Problem as refused:
            key_refusal = refused
    if not token_secret:
        if key_refusal is not None:
            raise key_refusal
        raise Problem(
            "unauthenticated",
            f"Re-enrolling workload {workload.id} needs a provisioning token minted for it or a "
            "request signed with its current key; the request carries neither.",
        )
    try:
        token = provisioning_token_check(secret=token_secret)
    except Problem:
        if key_refusal is not None:  # the agent's key is what it meant to use: say why that failed
            raise key_refusal from None
        raise
    if token.workload_id == workload.id:
        return token
    if key_refusal is not None:
        raise key_refusal
    if token.workload_id is None:
        why = "is a general token: it enrols new workloads and re-enrols none"
    else:
        why = f"was minted for workload {token.workload_id}"
    raise Problem(
        "enrolment-refused",
        f"The provisioning token {token.prefix} {why}. Re-enrolling workload {workload.id} needs a token "
        "minted for it (workload_id when minting) or a request signed with its current key.",
    )


def _key_proof_check(workload: Workload, proof: KeyProof, content: dict[str, Any]) -> None:
    """The proof first, then the workload's state: what became of a credential (revoked, and why) is
    told only to whom proves they hold its key."""
    now = clock.now()
    if proof.serial != workload.credential_serial:
        raise Problem(
            "unauthenticated",
            f"The key proof names credential serial {proof.serial}, not the workload's current one: a proof "
            "is good for one enrolment (sign a new one with the current credential's serial).",
        )
    signed_at = parse_instant(proof.signed_at) or now  # parsed with the input already
    if abs((now - signed_at).total_seconds()) > protocol.KEY_PROOF_MAX_SKEW_SECONDS:
        raise Problem(
            "unauthenticated",
            f"The key proof was signed at {proof.signed_at}, more than "
            f"{protocol.KEY_PROOF_MAX_SKEW_SECONDS // 60} min from the gateway's clock "
            f"({clock.rfc3339(now)}): sign a fresh one, and check the host's clock.",
        )
    if not protocol.verify_key_proof(
        workload.public_key,
        proof.signature,
        workload_id=str(workload.id),
        serial=proof.serial,
        signed_at=proof.signed_at,
        gateway_fingerprint=gateway_identity().fingerprint,
        **content,
    ):
        raise Problem(
            "unauthenticated",
            f"The key proof does not verify with the current key of workload {workload.id}, for this "
            "request's key, host name and addresses and this gateway.",
        )
    if workload.credential_revoked_at is not None:
        raise Problem(
            "credential-revoked",
            f"The credential of workload {workload.id} was revoked at "
            f"{clock.rfc3339(workload.credential_revoked_at)}"
            f"{revocation_reason_text(workload)}; its key re-enrols nothing. Re-enrol it with a "
            "provisioning token minted for it.",
        )
    if credential_beyond_grace(workload, now):
        raise Problem(
            "unauthenticated",
            f"The credential of workload {workload.id} expired beyond its renewal grace; its key re-enrols "
            "nothing. Re-enrol it with a provisioning token minted for it.",
        )


def _render_new_workload(workload: Workload, *, labels_before: dict[str, str]) -> None:
    """Render the enrolled workload's policy document, and the documents of workloads whose rules
    now (or before a re-enrolment) take it as a peer: its addresses appear in their sets. Runs inside
    the enrolment's transaction."""
    rerender_for_peer_change(workload_id=str(workload.id), labels_before=labels_before)

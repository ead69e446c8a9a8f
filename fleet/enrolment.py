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

from django.db import transaction

from agent.credential import CredentialError, public_key_decode, public_key_encode
from controlplane import clock
from controlplane.problems import pointer
from controlplane.text import has_unsafe
from controlplane.validation import Findings, quoted
from fleet.choices import Mode, SyncState
from fleet.credentials import CREDENTIAL_FIELDS, SignedCredential, credential_issue, credential_start
from fleet.models import Workload
from fleet.provisioning import provisioning_token_check, provisioning_token_consume
from fleet.push import notify_streams
from fleet.rendering import rerender_for_peer_change
from fleet.selectors import workload_get

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
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
            address = address.ipv4_mapped
        normalised.append(str(address))
    return list(dict.fromkeys(normalised))


def enrolment_input(*, public_key: Any, hostname: Any, addresses: Any, agent_version: Any) -> EnrolmentInput:
    """Check what an agent sends at enrolment; one finding per field to fix (paths as in the
    enrolment request body: /public_key, /hostname, /addresses/0, /agent_version)."""
    findings = Findings()
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
) -> Enrolled:
    """Enrol a workload with a provisioning token.

    New (no `workload_id`): mode `visibility`, sync state `offline` and never connected, the token's
    labels, and a fresh credential (serial 1). Re-enrolment (`workload_id` of an existing workload,
    e.g. a reinstalled host): keeps the id, labels, mode and history; takes the new public key,
    host name, addresses and agent version; issues a new credential (next serial) and clears any
    renewal failure. The token is checked first (`unauthenticated`), then the input (`validation`),
    then the workload (`not-found`)."""
    with transaction.atomic():
        token = provisioning_token_check(secret=token_secret)
        spec = enrolment_input(
            public_key=public_key, hostname=hostname, addresses=addresses, agent_version=agent_version
        )
        now = clock.now()
        if workload_id is None:
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
            labels_before: dict[str, str] = {}
        else:
            workload = workload_get(
                workload_id=workload_id,
                for_update=True,
                missing=f"No workload {workload_id} to re-enrol; enrol without a workload id.",
            )
            labels_before = dict(workload.labels)
            workload.hostname = spec.hostname
            workload.addresses = spec.addresses
            workload.agent_version = spec.agent_version
            workload.public_key = spec.public_key
            workload.enrolled_at = now
            workload.enrolled_with = token
            credential_start(workload, now=now, serial=workload.credential_serial + 1)
            workload.save(
                update_fields=[
                    "hostname",
                    "addresses",
                    "agent_version",
                    "public_key",
                    "enrolled_at",
                    "enrolled_with",
                    *CREDENTIAL_FIELDS,
                ]
            )
            # A stream still open under the old key must not outlive the re-enrolment.
            notify_streams([str(workload.id)], {"type": "stream.replaced", "stream_id": ""})
        _render_new_workload(workload, labels_before=labels_before)
        credential = credential_issue(workload=workload)
        provisioning_token_consume(secret=token_secret)
    return Enrolled(workload=workload, credential=credential, re_enrolled=workload_id is not None)


def _render_new_workload(workload: Workload, *, labels_before: dict[str, str]) -> None:
    """Render the enrolled workload's policy document, and the documents of workloads whose rules
    now (or before a re-enrolment) take it as a peer: its addresses appear in their sets. Runs inside
    the enrolment's transaction."""
    rerender_for_peer_change(workload_id=str(workload.id), labels_before=labels_before)

"""What the service says about itself: the gateway address agents are given and the fingerprint of
the certificate the gateway serves. One function, `gateway_identity()`, answers both for every caller
(`/me`, provisioning bundles, the stream's proofs). serve also records the flow retention it prunes by,
for commands run beside it."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from django.conf import settings

from controlplane import clock, runtime
from controlplane.models import GatewayIdentity


@dataclass(frozen=True)
class Identity:
    address: str
    fingerprint: str


def gateway_address() -> str:
    """`--gateway-advertise`, else the gateway listener's host (the host name for a wildcard) and port."""
    facts = runtime.facts
    if facts.advertised:
        return facts.advertised
    host = facts.gateway_host
    if host in ("", "0.0.0.0", "::"):  # noqa: S104 - recognising a wildcard, not binding one
        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{facts.gateway_port}"


def gateway_identity(*, certificate_if_unrecorded: bool = False) -> Identity:
    """Inside serve: its listener and served certificate. Elsewhere: what serve recorded at its last
    start; before any start, the advertised address and (with `certificate_if_unrecorded`, for a
    bundle) the certificate serve will use, made now if needed so the pinned fingerprint is the one
    serve will present. Without it, an unrecorded fingerprint is ""."""
    facts = runtime.facts
    if facts.gateway_fingerprint:
        return Identity(gateway_address(), facts.gateway_fingerprint)
    recorded = GatewayIdentity.objects.filter(id=1).first()
    if recorded is not None:
        return Identity(recorded.address, recorded.fingerprint)
    if not certificate_if_unrecorded:
        return Identity(gateway_address(), "")
    from controlplane import tls

    certificate = tls.ensure_certificate(settings.DATA_DIR, "gateway", [])
    return Identity(gateway_address(), certificate.fingerprint)


def gateway_identity_record(*, fingerprint: str) -> None:
    GatewayIdentity.objects.update_or_create(
        id=1,
        defaults={
            "address": gateway_address(),
            "fingerprint": fingerprint,
            "flow_retention_days": runtime.facts.retention_days,
            "updated_at": clock.now(),
        },
    )


def recorded_flow_retention_days() -> int | None:
    """The retention the last started serve prunes by; None before any start."""
    return GatewayIdentity.objects.filter(id=1).values_list("flow_retention_days", flat=True).first()

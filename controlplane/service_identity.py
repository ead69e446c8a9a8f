"""What the service says about itself: the gateway addresses agents are given (an ordered list: several
serve processes of one control plane, all presenting the same certificate) and the fingerprint of the
certificate the gateway serves. One function, `gateway_identity()`, answers both for every caller
(`/me`, provisioning bundles, the stream's proofs). serve also records the flow retention it prunes by,
for commands run beside it, and the list, which every serve process pushes to the agents it holds
(`gateway_addresses_recorded`)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from django.conf import settings

from controlplane import clock, runtime
from controlplane.models import GatewayIdentity


@dataclass(frozen=True)
class Identity:
    addresses: tuple[str, ...]
    fingerprint: str

    @property
    def address(self) -> str:
        return self.addresses[0]


def gateway_addresses() -> tuple[str, ...]:
    """`--gateway-advertise` (each, in order), else the gateway listener's host (the host name for a
    wildcard) and port."""
    facts = runtime.facts
    if facts.advertised:
        return facts.advertised
    return (_listener_address(),)


def gateway_address() -> str:
    """The first of `gateway_addresses()`."""
    return gateway_addresses()[0]


def _listener_address() -> str:
    facts = runtime.facts
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
        return Identity(gateway_addresses(), facts.gateway_fingerprint)
    recorded = GatewayIdentity.objects.filter(id=1).first()
    if recorded is not None:
        return Identity(_recorded_addresses(recorded), recorded.fingerprint)
    if not certificate_if_unrecorded:
        return Identity(gateway_addresses(), "")
    from controlplane import tls

    certificate = tls.ensure_certificate(settings.DATA_DIR, "gateway", [])
    return Identity(gateway_addresses(), certificate.fingerprint)


def _recorded_addresses(recorded: GatewayIdentity) -> tuple[str, ...]:
    listed = recorded.addresses if isinstance(recorded.addresses, list) else []
    return tuple(str(a) for a in listed) or (recorded.address,)


def gateway_addresses_recorded() -> tuple[str, ...]:
    """The list the last started serve process recorded: what every serve process gives its agents, so
    that a process started with a new `--gateway-advertise` list reaches the agents of the others."""
    recorded = GatewayIdentity.objects.filter(id=1).first()
    return _recorded_addresses(recorded) if recorded is not None else gateway_addresses()


def gateway_identity_record(*, fingerprint: str) -> None:
    addresses = gateway_addresses()
    GatewayIdentity.objects.update_or_create(
        id=1,
        defaults={
            "address": addresses[0],
            "addresses": list(addresses),
            "fingerprint": fingerprint,
            "flow_retention_days": runtime.facts.retention_days,
            "updated_at": clock.now(),
        },
    )


def recorded_flow_retention_days() -> int | None:
    """The retention the last started serve prunes by; None before any start."""
    return GatewayIdentity.objects.filter(id=1).values_list("flow_retention_days", flat=True).first()

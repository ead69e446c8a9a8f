"""What the service says about itself: the advertised gateway address and certificate fingerprint."""

import socket

from django.conf import settings

from controlplane import clock
from controlplane.models import GatewayIdentity


def gateway_address() -> str:
    """`--gateway-advertise`, else the gateway listener's host (the host name for a wildcard) and port."""
    if settings.PALISADE_GATEWAY_ADVERTISE:
        return settings.PALISADE_GATEWAY_ADVERTISE
    host = getattr(settings, "PALISADE_GATEWAY_HOST", "") or ""
    port = getattr(settings, "PALISADE_GATEWAY_PORT", 8443)
    if host in ("", "0.0.0.0", "::"):  # noqa: S104 - recognising a wildcard, not binding one
        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"


def gateway_identity_record(*, fingerprint: str) -> None:
    GatewayIdentity.objects.update_or_create(
        id=1, defaults={"address": gateway_address(), "fingerprint": fingerprint, "updated_at": clock.now()}
    )

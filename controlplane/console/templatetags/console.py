"""Filters the console's templates use to show API values to a person."""

from django import template

from controlplane.console.chips import duration_text, short_instant, short_version

register = template.Library()

register.filter("short_version", short_version)
register.filter("short_instant", short_instant)
register.filter("duration", duration_text)


@register.filter
def service_text(service: dict | None) -> str:
    """`tcp/443`, `udp/53`, `icmp`: a service key as people write it."""
    if not service:
        return ""
    protocol, port = service.get("protocol", ""), service.get("port")
    return f"{protocol}/{port}" if port else protocol


@register.filter
def decision_text(decision: str) -> str:
    return (decision or "").replace("_", "-")

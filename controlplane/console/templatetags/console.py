"""Filters the console's templates use to show API values to a person."""

from django import template

from controlplane.console.chips import countdown_text, duration_text, short_instant, short_version
from controlplane.text import visible
from flows.choices import AGGREGATE

register = template.Library()

register.filter("short_version", short_version)
register.filter("short_instant", short_instant)
register.filter("duration", duration_text)
register.filter("countdown", countdown_text)


# An agent's free text (its version, a gap's `lost` names) with control and format characters escaped:
# HTML escaping leaves a bidi override (U+202E) free to reorder what the page shows.
@register.filter("visible")
def visible_text(text: str | None) -> str:
    return visible(text or "")


@register.filter
def service_text(service: dict | None) -> str:
    """`tcp/443`, `udp/53`, `icmp`: a service key as people write it."""
    if not service:
        return ""
    protocol, port = service.get("protocol", ""), service.get("port")
    if protocol == AGGREGATE:
        return "other services (summed)"
    return f"{protocol}/{port}" if port else protocol


@register.filter
def peer_text(peer: str | None) -> str:
    """A peer address, or what the aggregate key stands for: the keys over a window's bound, summed."""
    return "other peers (summed: keys over the bound)" if peer == AGGREGATE else (peer or "")


@register.filter
def decision_text(decision: str) -> str:
    return (decision or "").replace("_", "-")


@register.filter
def deny_count(rules: list[dict] | None) -> int:
    """How many of a ruleset's rules are deny rules: the policy page's list shows them apart."""
    return sum(1 for rule in rules or () if rule.get("action") == "deny")


@register.filter
def get_item(mapping: dict | None, key: str | None):
    """`mapping[key]`, or None: a host name by workload id from an answer's `hostnames`."""
    return (mapping or {}).get(key or "")

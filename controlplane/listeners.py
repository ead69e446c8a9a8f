"""Which listener a request came in on. `serve` records the port of each listener; the ASGI entry
stamps every connection's scope with its listener before Django or Channels sees it."""

from __future__ import annotations

from django.conf import settings

OPERATOR = "operator"
GATEWAY = "gateway"


def listener_for_scope(scope: dict) -> str:
    server = scope.get("server")
    if server and len(server) >= 2:
        return settings.PALISADE_LISTENER_PORTS.get(server[1], OPERATOR)
    return OPERATOR


def listener_of(request) -> str:
    """Stamped into the request's environ by the HTTP entry (controlplane/http_threads.py)."""
    return request.META.get("palisade.listener", OPERATOR)

"""Headers for answers that may carry secrets, and for every answer of both listeners.

Strict-Transport-Security: both listeners speak TLS only, so a browser that has once reached one is
told never to try plain HTTP on that host again. No `includeSubDomains`: the service runs on whatever
host the operator picks, and the other names under that host's domain are not ours to commit to TLS.
Browsers apply it per host name, whatever the port, and ignore it on an IP address.

Cache-Control: no-store on every answer but the static files: API answers carry minted operator and
provisioning tokens, bundles, the session cookie and private fleet data, and gateway answers carry
agent credentials; none of them belongs in a browser's or a proxy's cache.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.conf import settings

STRICT_TRANSPORT_SECURITY = ("Strict-Transport-Security", "max-age=31536000")
NO_STORE = ("Cache-Control", "no-store")


def with_transport_security(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The answer's headers with Strict-Transport-Security, for answers made outside Django's middleware."""
    headers = list(headers)
    name, value = STRICT_TRANSPORT_SECURITY
    if not any(key.lower() == name.lower() for key, _ in headers):
        headers.append((name, value))
    return headers


class NoStoreMiddleware:
    """Outermost, so it covers the answers other middleware makes as well (404s, 413s, refusals)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if not request.path.startswith(settings.STATIC_URL):
            response[NO_STORE[0]] = NO_STORE[1]
        return response

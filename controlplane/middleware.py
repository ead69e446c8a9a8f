"""Request plumbing that holds for every request: the access log line, routing by listener, the body
size limit and the cross-origin guard."""

from __future__ import annotations

import logging
import time
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import DisallowedHost

from controlplane.api.errors import problem_response
from controlplane.listeners import GATEWAY, body_limit, listener_of
from controlplane.problems import Problem

access_log = logging.getLogger("palisade.access")

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


class AccessLogMiddleware:
    """One line per request: method, path, status and duration. Not for the 503s of a database
    outage: those are counted, a line per interval, by the outage log (controlplane.outage)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        started = time.perf_counter()
        response = self.get_response(request)
        if getattr(response, "database_unavailable", False):
            return response
        elapsed_ms = (time.perf_counter() - started) * 1000
        access_log.info(
            "%s %s %s %.1fms %s %s",
            request.method,
            request.get_full_path(),
            response.status_code,
            elapsed_ms,
            listener_of(request),
            request.META.get("REMOTE_ADDR", "-"),
        )
        return response


class ListenerRoutingMiddleware:
    """The gateway listener serves agent paths only; the operator listener everything else."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if listener_of(request) == GATEWAY:
            request.urlconf = settings.GATEWAY_URLCONF
            if request.path.startswith(settings.STATIC_URL):
                return problem_response(
                    Problem("not-found", f"No resource at {request.path}."), instance=request.path
                )
        return self.get_response(request)


class BodySizeLimitMiddleware:
    """413 before anything reads an oversized body."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        limit = body_limit(request.path)
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return problem_response(Problem("malformed-request", "Content-Length is not a number."))
        if length > limit:
            return problem_response(
                Problem("payload-too-large", f"The body exceeds {limit} bytes.", max_bytes=limit),
                instance=request.path,
            )
        return self.get_response(request)


def _origin_matches_host(origin: str, host: str) -> bool:
    parts = urlsplit(origin)
    if parts.scheme != "https" or not parts.hostname:
        return False
    origin_host = parts.hostname.lower()
    origin_port = parts.port or 443
    request = urlsplit("//" + host)
    if not request.hostname:
        return False
    try:
        request_port = request.port or 443
    except ValueError:
        return False
    return origin_host == request.hostname.lower() and origin_port == request_port


def _host_of(request) -> str:
    try:
        return request.get_host()
    except DisallowedHost:  # a Host header that is not a host at all
        return ""


def cross_origin_refusal(request) -> Problem | None:
    """Fetch Metadata first, then Origin; a request with neither header (a script) passes."""
    if request.method in SAFE_METHODS:
        return None
    site = request.META.get("HTTP_SEC_FETCH_SITE")
    if site is not None and site not in ("same-origin", "none"):
        return Problem(
            "cross-origin", f"Refused a {request.method} that the browser marked Sec-Fetch-Site: {site}."
        )
    origin = request.META.get("HTTP_ORIGIN")
    if origin is not None and not _origin_matches_host(origin, _host_of(request)):
        return Problem("cross-origin", f"Refused a {request.method} from origin {origin}.")
    return None


class CrossOriginGuardMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        refusal = cross_origin_refusal(request)
        if refusal is not None:
            return problem_response(refusal, instance=request.path)
        return self.get_response(request)

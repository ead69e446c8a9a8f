"""Every error response of the service as a problem document: DRF's exceptions, Django's 404 and 500,
and the domain's `Problem`s all pass through `problem_response`."""

from __future__ import annotations

import json
import logging
import math
import sys

from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent
from django.http import Http404, HttpResponse
from django.shortcuts import render
from rest_framework import exceptions as drf

from controlplane.listeners import GATEWAY, listener_of
from controlplane.outage import database_busy, database_failed, retry_after_seconds
from controlplane.problems import Finding, Problem, ValidationFailed, pointer

log = logging.getLogger("palisade.errors")

PROBLEM_CONTENT_TYPE = "application/problem+json"


def problem_response(problem: Problem, *, instance: str | None = None) -> HttpResponse:
    response = HttpResponse(
        json.dumps(problem.document(instance=instance)),
        status=problem.status,
        content_type=PROBLEM_CONTENT_TYPE,
    )
    for name, value in problem.headers.items():
        response[name] = value
    response.problem_name = problem.name  # type: ignore[attr-defined]  # the metrics' reason of a refusal
    if problem.name == "service-unavailable":
        _said_by_the_outage_log(response)
    return response


def _said_by_the_outage_log(response: HttpResponse) -> None:
    # The outage log has counted it (controlplane.outage): neither Django's request log nor the
    # access log adds a line per refused request.
    response._has_been_logged = True  # type: ignore[attr-defined]
    response.database_unavailable = True  # type: ignore[attr-defined]


def service_unavailable(error: BaseException | None = None) -> Problem:
    """The 503 of a database away, or busy (`error` says which: SQLite's one writer held the lock
    past the wait)."""
    wait = retry_after_seconds()
    what = (
        "The control plane's database is busy with another write"
        if error is not None and database_busy(error)
        else "The control plane cannot reach its database"
    )
    return Problem(
        "service-unavailable",
        f"{what}; retry in {wait} seconds.",
        headers={"Retry-After": str(wait)},
        retry_after=wait,
    )


def _findings_from_drf(detail, path: tuple = ()) -> list[Finding]:
    if isinstance(detail, dict):
        out: list[Finding] = []
        for key, value in detail.items():
            sub = path if key == "non_field_errors" else path + (key,)
            out.extend(_findings_from_drf(value, sub))
        return out
    if isinstance(detail, list):
        if all(isinstance(item, str) for item in detail):
            return [
                Finding(pointer(*path), getattr(item, "code", "invalid") or "invalid", str(item))
                for item in detail
            ]
        out = []
        for index, item in enumerate(detail):
            out.extend(_findings_from_drf(item, path + (index,)))
        return out
    return [Finding(pointer(*path), getattr(detail, "code", "invalid") or "invalid", str(detail))]


def problem_from_exception(exc: Exception) -> Problem | None:
    """The problem for an exception, or None when it is an unexpected failure (a 500)."""
    if isinstance(exc, Problem):
        return exc
    if database_failed("answer requests", exc, log):
        return service_unavailable(exc)
    if isinstance(exc, Http404):
        return Problem("not-found", "No such resource.")
    if isinstance(exc, RequestDataTooBig):
        from django.conf import settings

        return Problem("payload-too-large", max_bytes=settings.PALISADE_MAX_BODY_BYTES)
    if isinstance(exc, TooManyFieldsSent):
        from django.conf import settings

        return Problem(
            "malformed-request",
            f"The request has more than {settings.DATA_UPLOAD_MAX_NUMBER_FIELDS:,} query parameters.",
        )
    if isinstance(exc, drf.ParseError):
        return Problem("malformed-request", f"The body is not valid JSON: {exc.detail}")
    if isinstance(exc, (drf.NotAuthenticated, drf.AuthenticationFailed)):
        return Problem(
            "unauthenticated", str(exc.detail), headers={"WWW-Authenticate": 'Bearer realm="palisade"'}
        )
    if isinstance(exc, drf.NotFound):
        return Problem("not-found", str(exc.detail))
    if isinstance(exc, drf.MethodNotAllowed):
        return Problem("method-not-allowed", str(exc.detail))
    if isinstance(exc, drf.NotAcceptable):
        return Problem("not-acceptable", str(exc.detail))
    if isinstance(exc, drf.UnsupportedMediaType):
        return Problem("unsupported-media-type", str(exc.detail))
    if isinstance(exc, drf.Throttled):
        wait = math.ceil(exc.wait or 1)
        return Problem("rate-limited", str(exc.detail), headers={"Retry-After": str(wait)}, retry_after=wait)
    if isinstance(exc, drf.ValidationError):
        return ValidationFailed(_findings_from_drf(exc.detail))
    if isinstance(exc, drf.PermissionDenied):
        # There are no roles: the only refusal of an authenticated caller is the origin guard.
        return Problem("cross-origin", str(exc.detail))
    if isinstance(exc, drf.APIException):
        log.error("unmapped API exception %s: %s", type(exc).__name__, exc)
        return Problem("internal", "The service failed; see the host's log.")
    return None


def exception_handler(exc, context):
    """DRF's EXCEPTION_HANDLER: every error a view raises leaves as a problem document."""
    problem = problem_from_exception(exc)
    request = context.get("request")
    if problem is None:
        log.exception(
            "unhandled error in %s %s", getattr(request, "method", "?"), getattr(request, "path", "?")
        )
        problem = Problem("internal", "The service failed; see the host's log.")
    response = problem_response(problem, instance=getattr(request, "path", None))
    response.exception = True
    return response


def handler404(request, exception=None):
    return problem_response(Problem("not-found", f"No resource at {request.path}."), instance=request.path)


def handler500(request):
    """Django's answer to what escaped a view or a middleware (Django logs it after, unless told it
    is logged): the database away is a 503, as a problem or, for a console page, a page saying so."""
    error = sys.exc_info()[1]
    unavailable = error is not None and (
        (isinstance(error, Problem) and error.name == "service-unavailable")
        or database_failed("answer requests", error, log)
    )
    if not unavailable:
        return problem_response(
            Problem("internal", "The service failed; see the host's log."), instance=request.path
        )
    problem = error if isinstance(error, Problem) else service_unavailable(error)
    if listener_of(request) == GATEWAY or request.path.startswith("/api/"):
        return problem_response(problem, instance=request.path)
    response = render(
        request,
        "console/unavailable.html",
        {"retry_after": problem.extensions.get("retry_after")},
        status=503,
    )
    for name, value in problem.headers.items():
        response[name] = value
    _said_by_the_outage_log(response)
    return response


def handler400(request, exception=None):
    return problem_response(Problem("malformed-request", "The request is malformed."), instance=request.path)


def handler403(request, exception=None):
    return problem_response(Problem("cross-origin", "Refused."), instance=request.path)

"""DRF authentication: `Authorization: Bearer <operator token>` or the session cookie.

A credential that is present but not valid is refused outright (401), never ignored in favour of
another one, so a script with a revoked token learns it at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from http.cookies import CookieError, SimpleCookie

from django.conf import settings
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed

from controlplane.auth.services import operator_token_authenticate, session_authenticate
from controlplane.problems import Problem


class BearerTokenAuthentication(BaseAuthentication):
    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION")
        if header is None:
            return None
        scheme, _, secret = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise AuthenticationFailed("Malformed Authorization header; expected `Bearer <operator token>`.")
        actor = operator_token_authenticate(secret=secret.strip())
        if actor is None:
            raise AuthenticationFailed("The operator token is unknown, revoked or expired.")
        # DRF stops at the first class that authenticates: the cookie beside the token is checked here.
        cookie = request.COOKIES.get(settings.PALISADE_SESSION_COOKIE)
        if cookie is not None and session_authenticate(secret=cookie) is None:
            raise AuthenticationFailed(
                "The session cookie sent beside the token has ended or expired; drop it or log in again."
            )
        return actor, actor

    def authenticate_header(self, request):
        return 'Bearer realm="palisade"'


class SessionCookieAuthentication(BaseAuthentication):
    def authenticate(self, request):
        secret = request.COOKIES.get(settings.PALISADE_SESSION_COOKIE)
        if secret is None:
            return None
        actor = session_authenticate(secret=secret)
        if actor is None:
            raise AuthenticationFailed("The session has ended or expired; log in again.")
        return actor, actor


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.auth.authentication.BearerTokenAuthentication"
    name = "operatorToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "An operator token (`pal_op_...`)."}


class SessionCookieScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.auth.authentication.SessionCookieAuthentication"
    name = "sessionCookie"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "cookie", "name": settings.PALISADE_SESSION_COOKIE}


def operator_credential_check(headers: Mapping[str, str]) -> None:
    """A request's credential from its headers alone, before serve receives its body (run by
    controlplane/body_gate.py for every body on the operator listener but a login's): an operator token
    or a live session cookie, else the `unauthenticated` problem. The view authenticates the request
    again, in full, once the body is in; this only keeps those who hold no credential from holding the
    listener's budget of bodies in flight."""
    header = headers.get("Authorization")
    if header is not None:
        scheme, _, secret = header.strip().partition(" ")
        if (
            scheme.lower() == "bearer"
            and secret.strip()
            and operator_token_authenticate(secret=secret.strip())
        ):
            return
        raise Problem("unauthenticated", "The operator token is malformed, unknown, revoked or expired.")
    cookie = _cookie(headers.get("Cookie") or "", settings.PALISADE_SESSION_COOKIE)
    if cookie is not None and session_authenticate(secret=cookie) is not None:
        return
    raise Problem(
        "unauthenticated",
        "A request with a body needs a credential: `Authorization: Bearer <operator token>` or a live "
        "session cookie (log in again).",
    )


def _cookie(header: str, name: str) -> str | None:
    try:
        morsel = SimpleCookie(header).get(name)
    except CookieError:
        return None
    return morsel.value if morsel is not None else None

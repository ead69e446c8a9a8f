"""POST/DELETE /session and GET /me."""

from django.conf import settings
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane import __version__, runtime
from controlplane.api.schema import COMMON_ERRORS, WRITE_ERRORS, problem
from controlplane.auth.services import session_close, session_input, session_open
from controlplane.clock import rfc3339
from controlplane.service_identity import gateway_address, gateway_addresses

LoginRequest = inline_serializer("Login", {"password": serializers.CharField()})
LoginResponse = inline_serializer(
    "LoginResponse", {"operator": serializers.CharField(), "expires_at": serializers.DateTimeField()}
)
MeResponse = inline_serializer(
    "Me",
    {
        "operator": serializers.CharField(),
        "credential": inline_serializer(
            "MeCredential",
            {
                "kind": serializers.ChoiceField(choices=["session", "token"]),
                "label": serializers.CharField(),
            },
        ),
        "site_label": serializers.CharField(),
        "gateway_address": serializers.CharField(
            help_text="host:port agents enrol and stream to: the first of `gateway_addresses`."
        ),
        "gateway_addresses": serializers.ListField(
            child=serializers.CharField(),
            help_text="Every gateway (host:port) agents are given, in the order they try them.",
        ),
        "version": serializers.CharField(help_text="The control plane's version."),
        "outbound_failsafe": serializers.ListField(
            child=serializers.CharField(),
            help_text="The fail-safe list (PALISADE_OUTBOUND_FAILSAFE): what every output chain admits to any "
            "destination before any rule, as `protocol/port` or `protocol/first-last`.",
        ),
    },
)


class SessionView(APIView):
    def _logging_in(self) -> bool:
        request = getattr(self, "request", None)
        return request is not None and request.method == "POST"

    def get_authenticators(self):
        # Logging in needs no credential, and a stale cookie sent along must not block it.
        return [] if self._logging_in() else super().get_authenticators()

    def get_permissions(self):
        return [AllowAny()] if self._logging_in() else super().get_permissions()

    @extend_schema(
        operation_id="session_login",
        request=LoginRequest,
        responses={200: LoginResponse, **WRITE_ERRORS},
        auth=[],
        summary="Log in with the operator password; sets the session cookie.",
    )
    def post(self, request):
        password = session_input(request.data)
        opened = session_open(password=password, client=request.META.get("REMOTE_ADDR", "unknown"))
        response = Response({"operator": "operator", "expires_at": rfc3339(opened.expires_at)})
        response.set_cookie(
            settings.PALISADE_SESSION_COOKIE,
            opened.secret,
            expires=opened.expires_at,
            secure=True,
            httponly=True,
            samesite="Strict",
            path="/",
        )
        return response

    @extend_schema(
        operation_id="session_logout",
        request=None,
        responses={
            204: None,
            422: problem("`validation` (`not-a-session`): the request carried no session cookie."),
            **COMMON_ERRORS,
        },
    )
    def delete(self, request):
        session_close(actor=request.user)
        response = Response(status=204)
        response.delete_cookie(settings.PALISADE_SESSION_COOKIE, path="/", samesite="Strict")
        return response


class MeView(APIView):
    @extend_schema(operation_id="me", responses={200: MeResponse, **COMMON_ERRORS})
    def get(self, request):
        actor = request.user
        return Response(
            {
                "operator": "operator",
                "credential": {"kind": actor.kind, "label": actor.label},
                "site_label": runtime.facts.label,
                "gateway_address": gateway_address(),
                "gateway_addresses": list(gateway_addresses()),
                "version": __version__,
                "outbound_failsafe": [
                    f"{protocol}/{first}" if first == last else f"{protocol}/{first}-{last}"
                    for protocol, first, last in settings.PALISADE_OUTBOUND_FAILSAFE
                ],
            }
        )

"""GET/POST /provisioning-tokens and DELETE /provisioning-tokens/{id}."""

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api.responses import page_params, page_response
from controlplane.api.schema import COMMON_ERRORS, PAGE_PARAMETERS, WRITE_ERRORS, page_of, problem
from controlplane.clock import rfc3339
from fleet.provisioning import (
    ACTIVE,
    EXPIRED,
    REVOKED,
    USED_UP,
    provisioning_token_list,
    provisioning_token_mint,
    provisioning_token_revoke,
    provisioning_token_state,
)


class ProvisioningTokenSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    description = serializers.CharField()
    prefix = serializers.CharField(help_text="The first characters of the token, to recognise it.")
    labels = serializers.DictField(
        child=serializers.CharField(allow_blank=True), help_text="Given to every workload the token enrols."
    )
    created_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField(allow_null=True, help_text="null: never expires.")
    max_uses = serializers.IntegerField(allow_null=True, help_text="null: unlimited.")
    uses = serializers.IntegerField(help_text="Enrolments made with the token.")
    last_used_at = serializers.DateTimeField(allow_null=True)
    revoked_at = serializers.DateTimeField(allow_null=True)
    workload_id = serializers.UUIDField(
        allow_null=True,
        help_text="The one workload this token re-enrols (one use; it enrols nothing else). null: a general "
        "token, which enrols new workloads and re-enrols none.",
    )
    state = serializers.ChoiceField(
        choices=[ACTIVE, REVOKED, EXPIRED, USED_UP],
        help_text="`active`, or why the token enrols nothing (revoked wins over expired, expired over used-up).",
    )


def provisioning_token_data(token) -> dict:
    return {
        "id": str(token.id),
        "description": token.description,
        "prefix": token.prefix,
        "labels": dict(token.labels),
        "created_at": rfc3339(token.created_at),
        "expires_at": rfc3339(token.expires_at),
        "max_uses": token.max_uses,
        "uses": token.uses,
        "last_used_at": rfc3339(token.last_used_at),
        "revoked_at": rfc3339(token.revoked_at),
        "workload_id": str(token.workload_id) if token.workload_id else None,
        "state": provisioning_token_state(token),
    }


MintRequest = inline_serializer(
    "ProvisioningTokenMint",
    {
        "description": serializers.CharField(max_length=1000),
        "expires_at": serializers.DateTimeField(
            required=False,
            allow_null=True,
            help_text="Future RFC 3339 instant; absent or null: never expires.",
        ),
        "max_uses": serializers.IntegerField(required=False, allow_null=True, min_value=1),
        "labels": serializers.DictField(
            child=serializers.CharField(allow_blank=True),
            required=False,
            help_text="Label set (label grammar, at most 64) given to every workload the token enrols; "
            "none with `workload_id`.",
        ),
        "workload_id": serializers.UUIDField(
            required=False,
            allow_null=True,
            help_text="Mint the token to re-enrol this one workload (the operator's consent, e.g. for a "
            "reinstalled host or after revoke-credential): exactly one use, no labels, and it enrols "
            "nothing else. Absent or null: a general token, which enrols new workloads only.",
        ),
    },
)
MintResponse = inline_serializer(
    "ProvisioningTokenMinted",
    {
        "token": serializers.CharField(help_text="The plaintext `pal_pt_...`, shown this once."),
        "bundle": serializers.CharField(
            help_text="`palisade-enrol-v1:...`: gateway address, gateway certificate fingerprint and the token, "
            "the one string an agent is started with. Shown this once."
        ),
        "record": ProvisioningTokenSerializer(),
    },
)


class ProvisioningTokenListView(APIView):
    @extend_schema(
        operation_id="provisioning_tokens_list",
        parameters=PAGE_PARAMETERS,
        responses={200: page_of("ProvisioningTokenPage", ProvisioningTokenSerializer()), **COMMON_ERRORS},
    )
    def get(self, request):
        cursor, limit = page_params(request)
        page = provisioning_token_list(cursor=cursor, limit=limit)
        return page_response(page, [provisioning_token_data(t) for t in page.items])

    @extend_schema(
        operation_id="provisioning_tokens_mint",
        request=MintRequest,
        responses={201: MintResponse, **WRITE_ERRORS},
    )
    def post(self, request):
        minted = provisioning_token_mint(actor=request.user, data=request.data)
        return Response(
            {
                "token": minted.secret,
                "bundle": minted.bundle,
                "record": provisioning_token_data(minted.token),
            },
            status=201,
        )


class ProvisioningTokenView(APIView):
    @extend_schema(
        operation_id="provisioning_tokens_revoke",
        responses={200: ProvisioningTokenSerializer, 404: problem("`not-found`."), **WRITE_ERRORS},
    )
    def delete(self, request, token_id):
        token = provisioning_token_revoke(actor=request.user, token_id=str(token_id))
        return Response(provisioning_token_data(token))

"""GET/POST /operator-tokens and DELETE /operator-tokens/{id}."""

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api.responses import page_params, page_response
from controlplane.api.schema import COMMON_ERRORS, PAGE_PARAMETERS, WRITE_ERRORS, page_of, problem
from controlplane.auth.selectors import operator_token_list
from controlplane.auth.services import operator_token_mint, operator_token_revoke
from controlplane.clock import rfc3339


class OperatorTokenSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    prefix = serializers.CharField(help_text="The first characters of the token, to recognise it.")
    created_at = serializers.DateTimeField()
    last_used_at = serializers.DateTimeField(allow_null=True, help_text="To the minute.")
    expires_at = serializers.DateTimeField(allow_null=True)
    revoked_at = serializers.DateTimeField(allow_null=True)


def operator_token_data(token) -> dict:
    return {
        "id": str(token.id),
        "name": token.name,
        "prefix": token.prefix,
        "created_at": rfc3339(token.created_at),
        "last_used_at": rfc3339(token.last_used_at),
        "expires_at": rfc3339(token.expires_at),
        "revoked_at": rfc3339(token.revoked_at),
    }


MintRequest = inline_serializer(
    "OperatorTokenMint",
    {"name": serializers.CharField(max_length=100), "expires_at": serializers.DateTimeField(required=False)},
)
MintResponse = inline_serializer(
    "OperatorTokenMinted",
    {
        "token": serializers.CharField(help_text="The plaintext, shown this once."),
        "record": OperatorTokenSerializer(),
    },
)


class OperatorTokenListView(APIView):
    @extend_schema(
        operation_id="operator_tokens_list",
        parameters=PAGE_PARAMETERS,
        responses={200: page_of("OperatorTokenPage", OperatorTokenSerializer()), **COMMON_ERRORS},
    )
    def get(self, request):
        cursor, limit = page_params(request)
        page = operator_token_list(cursor=cursor, limit=limit)
        return page_response(page, [operator_token_data(t) for t in page.items])

    @extend_schema(
        operation_id="operator_tokens_mint",
        request=MintRequest,
        responses={201: MintResponse, **WRITE_ERRORS},
    )
    def post(self, request):
        minted = operator_token_mint(actor=request.user, data=request.data)
        return Response({"token": minted.secret, "record": operator_token_data(minted.token)}, status=201)


class OperatorTokenView(APIView):
    @extend_schema(
        operation_id="operator_tokens_revoke",
        responses={200: OperatorTokenSerializer, 404: problem("`not-found`."), **WRITE_ERRORS},
    )
    def delete(self, request, token_id):
        token = operator_token_revoke(actor=request.user, token_id=str(token_id))
        return Response(operator_token_data(token))

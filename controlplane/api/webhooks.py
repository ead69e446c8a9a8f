"""GET/POST /webhooks, GET/DELETE /webhooks/{id} and GET /webhooks/{id}/deliveries (docs/webhooks.md)."""

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api.responses import page_params, page_response
from controlplane.api.schema import COMMON_ERRORS, PAGE_PARAMETERS, WRITE_ERRORS, page_of, problem
from controlplane.webhooks.outbox import EVENT_TYPES
from controlplane.webhooks.selectors import (
    attempt_data,
    webhook_attempts_list,
    webhook_data,
    webhook_detail_data,
    webhook_get,
    webhook_list,
    webhooks_data,
)
from controlplane.webhooks.services import webhook_create, webhook_delete


class WebhookSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    url = serializers.CharField(
        help_text="https; a receiver on this host (loopback) only on a port listed in "
        "PALISADE_WEBHOOK_LOOPBACK_PORTS, and plain http only there (docs/webhooks.md)."
    )
    events = serializers.ListField(child=serializers.ChoiceField(choices=list(EVENT_TYPES)))
    description = serializers.CharField(allow_blank=True)
    created_at = serializers.DateTimeField()


class WebhookDetailSerializer(WebhookSerializer):
    deliveries = inline_serializer(
        "WebhookBacklog",
        {
            "pending": serializers.IntegerField(help_text="Deliveries not yet delivered nor given up."),
            "oldest_pending_since": serializers.DateTimeField(allow_null=True),
        },
    )


class WebhookAttemptSerializer(serializers.Serializer):
    id = serializers.CharField()
    event = inline_serializer(
        "WebhookAttemptEvent",
        {"id": serializers.CharField(help_text="The `webhook-id` header."), "type": serializers.CharField()},
    )
    attempt = serializers.IntegerField(
        help_text="1 for the delivery's first attempt; 0: the delivery was given up unsent (over the "
        "backlog cap, or with the rest of a receiver given up on), `error` says which."
    )
    at = serializers.DateTimeField()
    duration_ms = serializers.IntegerField()
    status_code = serializers.IntegerField(allow_null=True, help_text="null: no HTTP answer.")
    error = serializers.CharField(
        allow_null=True, help_text="Why it failed, in Palisade's words (never the receiver's answer)."
    )
    outcome = serializers.ChoiceField(choices=["delivered", "retrying", "gave_up"])
    next_attempt_at = serializers.DateTimeField(allow_null=True, help_text="When `retrying`.")


CreateRequest = inline_serializer(
    "WebhookCreate",
    {
        "url": serializers.CharField(max_length=2000),
        "events": serializers.ListField(child=serializers.ChoiceField(choices=list(EVENT_TYPES))),
        "description": serializers.CharField(max_length=1000, required=False),
    },
)
CreateResponse = inline_serializer(
    "WebhookCreated",
    {
        "secret": serializers.CharField(
            help_text="The signing secret (`whsec_...`), shown this once: verify signatures with it."
        ),
        "record": WebhookSerializer(),
    },
)


class WebhookListView(APIView):
    @extend_schema(
        operation_id="webhooks_list",
        parameters=PAGE_PARAMETERS,
        responses={200: page_of("WebhookPage", WebhookDetailSerializer()), **COMMON_ERRORS},
    )
    def get(self, request):
        cursor, limit = page_params(request)
        page = webhook_list(cursor=cursor, limit=limit)
        return page_response(page, webhooks_data(list(page.items)))

    @extend_schema(
        operation_id="webhooks_create",
        request=CreateRequest,
        responses={201: CreateResponse, **WRITE_ERRORS},
    )
    def post(self, request):
        created = webhook_create(actor=request.user, data=request.data)
        return Response({"secret": created.secret, "record": webhook_data(created.webhook)}, status=201)


class WebhookView(APIView):
    @extend_schema(
        operation_id="webhooks_get",
        responses={200: WebhookDetailSerializer, 404: problem("`not-found`."), **COMMON_ERRORS},
    )
    def get(self, request, webhook_id):
        return Response(webhook_detail_data(webhook_get(webhook_id=webhook_id)))

    @extend_schema(
        operation_id="webhooks_delete",
        responses={200: WebhookSerializer, 404: problem("`not-found`."), **WRITE_ERRORS},
    )
    def delete(self, request, webhook_id):
        return Response(webhook_data(webhook_delete(actor=request.user, webhook_id=str(webhook_id))))


class WebhookDeliveryListView(APIView):
    @extend_schema(
        operation_id="webhooks_deliveries",
        parameters=PAGE_PARAMETERS,
        responses={
            200: page_of("WebhookAttemptPage", WebhookAttemptSerializer()),
            404: problem("`not-found`."),
            **COMMON_ERRORS,
        },
    )
    def get(self, request, webhook_id):
        cursor, limit = page_params(request)
        page = webhook_attempts_list(webhook_id=webhook_id, cursor=cursor, limit=limit)
        return page_response(page, [attempt_data(a) for a in page.items])

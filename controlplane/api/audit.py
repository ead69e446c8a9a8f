"""GET /audit-events: the audit trail, newest first. Read-only: no method changes or deletes it."""

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api.responses import page_params, page_response
from controlplane.api.schema import COMMON_ERRORS, PAGE_PARAMETERS, page_of, problem
from controlplane.audit import OBJECT_TYPES, audit_event_data, audit_events_list


class AuditEventSerializer(serializers.Serializer):
    id = serializers.CharField()
    at = serializers.DateTimeField()
    actor = inline_serializer(
        "AuditActor",
        {
            "kind": serializers.ChoiceField(choices=["session", "token", "cli", "agent", "system"]),
            "label": serializers.CharField(
                help_text="The token's name and prefix, the host command line, or `system`."
            ),
            "token_id": serializers.UUIDField(allow_null=True),
        },
    )
    action = serializers.CharField(help_text="`<object type>.<verb>`, e.g. `service.replace`.")
    object = inline_serializer(
        "AuditObject",
        {
            "type": serializers.ChoiceField(choices=list(OBJECT_TYPES)),
            "id": serializers.CharField(),
            "name": serializers.CharField(allow_blank=True),
        },
    )
    version_before = serializers.CharField(allow_null=True, help_text="null: the write created the object.")
    version_after = serializers.CharField(allow_null=True, help_text="null: the write deleted the object.")
    detail = serializers.DictField(help_text="What the write asked for, where the versions do not say it.")


FILTERS = [
    OpenApiParameter("object_type", OpenApiTypes.STR, enum=list(OBJECT_TYPES)),
    OpenApiParameter("object_id", OpenApiTypes.STR, description="With `object_type`: one object's history."),
    OpenApiParameter("since", OpenApiTypes.DATETIME, description="Inclusive, RFC 3339 with an offset."),
    OpenApiParameter("until", OpenApiTypes.DATETIME, description="Exclusive, RFC 3339 with an offset."),
]


class AuditEventListView(APIView):
    @extend_schema(
        operation_id="audit_events_list",
        parameters=[*FILTERS, *PAGE_PARAMETERS],
        responses={
            200: page_of("AuditEventPage", AuditEventSerializer()),
            422: problem("`validation`: a filter or paging parameter out of range."),
            **COMMON_ERRORS,
        },
    )
    def get(self, request) -> Response:
        cursor, limit = page_params(request)
        page = audit_events_list(
            object_type=request.query_params.get("object_type"),
            object_id=request.query_params.get("object_id"),
            since=request.query_params.get("since"),
            until=request.query_params.get("until"),
            cursor=cursor,
            limit=limit,
        )
        return page_response(page, [audit_event_data(event) for event in page.items])

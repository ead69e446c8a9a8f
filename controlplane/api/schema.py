"""OpenAPI pieces shared by every endpoint: the problem document and the paging parameters."""

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, inline_serializer
from rest_framework import serializers

from controlplane.heavy_pool import HEAVY_PATHS
from controlplane.problems import PROBLEM_TYPES, PROBLEM_URN

_TYPES_TEXT = "\n".join(
    f"- `{PROBLEM_URN}{name}` ({kind.status}): {kind.description}" for name, kind in PROBLEM_TYPES.items()
)


PROBLEM_TYPE_CHOICES = [PROBLEM_URN + name for name in PROBLEM_TYPES]


class FindingSerializer(serializers.Serializer):
    path = serializers.CharField(
        help_text="JSON Pointer into the request body; `?name` for a query parameter."
    )
    rule = serializers.CharField(help_text="Stable name of the rule broken.")
    message = serializers.CharField()


class ProblemSerializer(serializers.Serializer):
    type = serializers.ChoiceField(choices=PROBLEM_TYPE_CHOICES, help_text="Problem types:\n" + _TYPES_TEXT)
    title = serializers.CharField()
    status = serializers.IntegerField()
    detail = serializers.CharField()
    instance = serializers.CharField(required=False)
    errors = FindingSerializer(many=True, required=False, help_text="`validation` only.")
    current_version = serializers.CharField(required=False, help_text="`precondition-failed` only.")
    retry_after = serializers.IntegerField(
        required=False, help_text="`rate-limited` and `service-unavailable` only."
    )
    max_bytes = serializers.IntegerField(
        required=False, help_text="`payload-too-large` and `answer-too-large` only."
    )
    deadline_seconds = serializers.FloatField(required=False, help_text="`deadline-exceeded` only.")
    referenced_by = serializers.ListField(
        child=serializers.DictField(), required=False, help_text="`in-use` only."
    )
    last_heard_from = serializers.DateTimeField(
        required=False, allow_null=True, help_text="`workload-offline` only; null: never connected."
    )
    confirm_by = serializers.DateTimeField(required=False, help_text="`confirmation-deadline-passed` only.")
    reverted_by = serializers.UUIDField(
        required=False,
        allow_null=True,
        help_text="`confirmation-deadline-passed` only: the system's mode change that put it back; null: "
        "not yet.",
    )


def problem(description: str) -> OpenApiResponse:
    return OpenApiResponse(response=ProblemSerializer, description=description)


COMMON_ERRORS = {
    401: problem("`unauthenticated`: no valid credential."),
    429: problem("`rate-limited`."),
}
WRITE_ERRORS = {
    **COMMON_ERRORS,
    403: problem("`cross-origin`: refused a browser request from another origin."),
    413: problem("`payload-too-large`."),
    415: problem("`unsupported-media-type`."),
    422: problem("`validation`: one finding per field to fix."),
    503: problem(
        "`service-unavailable`: the database is away, or no room for the body yet; retry after "
        "`retry_after` seconds (also the `Retry-After` header)."
    ),
}
CONDITIONAL_ERRORS = {
    **WRITE_ERRORS,
    404: problem("`not-found`."),
    412: problem("`precondition-failed`: the version moved; carries `current_version`."),
    428: problem("`precondition-required`: If-Match is missing."),
}

IF_MATCH = OpenApiParameter(
    "If-Match",
    {"type": "string", "pattern": '^"[^",*]+"$', "maxLength": 200},
    OpenApiParameter.HEADER,
    required=True,
    description="The version you read: its strong ETag, quoted (a weak ETag, `*` or a list is refused).",
)
CURSOR = OpenApiParameter("cursor", OpenApiTypes.STR, description="Opaque cursor from `next_cursor`.")
LIMIT = OpenApiParameter(
    "limit",
    {"type": "integer", "minimum": 1, "maximum": 500, "default": 100},
    description="Page size, 1-500 (default 100).",
)
PAGE_PARAMETERS = [CURSOR, LIMIT]


def page_of(name: str, item: serializers.Serializer):
    return inline_serializer(
        name=name,
        fields={"items": item.__class__(many=True), "next_cursor": serializers.CharField(allow_null=True)},
    )


_ANY_REQUEST_ERROR = (
    "`malformed-request`: the body is not JSON, or a header (If-Match, Authorization) is malformed."
)
_INTERNAL_ERROR = "`internal`: the service failed; the error is in the host's log, never in the response."
_UNAVAILABLE_ERROR = (
    "`service-unavailable`: the service cannot reach its database; retry after `retry_after` seconds "
    "(also the `Retry-After` header)."
)
_PAGING_ERROR = "`validation`: `?limit` out of range or a `?cursor` this service did not issue."
_ANSWER_TOO_LARGE = (
    "Or `answer-too-large`: the answer would exceed `max_bytes` (PALISADE_HEAVY_MAX_ANSWER_BYTES); nothing "
    "was sent."
)
_HEAVY_ERRORS = {
    "429": "`rate-limited`: as many heavy requests as serve admits are running and waiting; retry after "
    "`retry_after` seconds (also the `Retry-After` header).",
    "504": "`deadline-exceeded`: the request ran past `deadline_seconds` (PALISADE_HEAVY_DEADLINE_SECONDS) "
    "and was stopped; nothing was changed.",
}


def problems_as_problem_json(result, generator, request, public):
    """drf-spectacular post-processing hook: every error is `application/problem+json` (as the server
    sends it), and the errors any operation can meet are declared on every operation that can meet them:
    400, 500 and 503 on all (a malformed header; a failure; the database away), 422 on paged lists (a
    bad `limit` or `cursor`), and on the heavy operations (controlplane/heavy_pool.py) what serve's
    heavy workers answer: 422 `answer-too-large`, 429 when busy, 504 `deadline-exceeded`."""
    problem_ref = {"$ref": "#/components/schemas/Problem"}
    # Request bodies refuse members they do not name (`unknown-field`); say so.
    for name, component in result.get("components", {}).get("schemas", {}).items():
        if name.endswith("Request") and "properties" in component:
            component.setdefault("additionalProperties", False)
    for path, operations in result.get("paths", {}).items():
        for operation in operations.values():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            responses = operation["responses"]
            if path in HEAVY_PATHS:
                for status, description in _HEAVY_ERRORS.items():
                    responses[status] = {"description": description}
                invalid = responses.setdefault("422", {"description": "`validation`."})
                invalid["description"] = f"{invalid['description']} {_ANSWER_TOO_LARGE}"
            responses.setdefault("400", {"description": _ANY_REQUEST_ERROR})
            responses.setdefault("500", {"description": _INTERNAL_ERROR})
            responses.setdefault("503", {"description": _UNAVAILABLE_ERROR})
            if any(parameter.get("name") == "cursor" for parameter in operation.get("parameters", [])):
                responses.setdefault("422", {"description": _PAGING_ERROR})
            for status, response in responses.items():
                if int(status) >= 400:
                    response["content"] = {"application/problem+json": {"schema": problem_ref}}
            operation["responses"] = dict(sorted(responses.items()))
    return result

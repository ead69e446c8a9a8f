"""GET /flows (one workload's stored windows) and GET /flows/gaps (the gaps of a set of workloads)."""

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api.responses import page_params, page_response
from controlplane.api.schema import COMMON_ERRORS, PAGE_PARAMETERS, page_of, problem
from controlplane.validation import parsed_together
from flows import selectors, validation
from flows.api.schemas import (
    EvidenceGapSerializer,
    FlowWindowSerializer,
    RollupSerializer,
)
from flows.choices import READ_DIRECTIONS, Decision, Direction
from flows.representations import (
    coverage_data,
    evidence_gap_data,
    flow_window_data,
    rollup_data,
)

RANGE = [
    OpenApiParameter(
        "from",
        OpenApiTypes.DATETIME,
        required=True,
        description="RFC 3339, from 1970 to 9000; windows and gaps ending after it.",
    ),
    OpenApiParameter(
        "to",
        OpenApiTypes.DATETIME,
        required=True,
        description="RFC 3339, from 1970 to 9000; starting before it. At most 31 days after `from`.",
    ),
]
DIRECTION = OpenApiParameter(
    "direction",
    OpenApiTypes.STR,
    enum=list(READ_DIRECTIONS),
    default=Direction.INBOUND,
    description=(
        "Whose connections: `inbound` (the default: peers' connections to the workload, every answer as "
        "before outbound evidence), `outbound` (the workload's own, to a destination), or `any`."
    ),
)
INVALID = {
    422: problem("`validation`: a missing or malformed range, a range over 31 days, a bad cursor or limit.")
}
NOT_FOUND = {404: problem("`not-found`: no such workload.")}


def _range(request):
    return validation.flow_range_parse(
        start=request.query_params.get("from"), end=request.query_params.get("to")
    )


class FlowWindowListView(APIView):
    @extend_schema(
        operation_id="flows_list",
        parameters=[
            OpenApiParameter(
                "workload",
                OpenApiTypes.UUID,
                required=True,
                description="The workload whose windows to read.",
            ),
            *RANGE,
            OpenApiParameter("decision", OpenApiTypes.STR, enum=Decision.values),
            OpenApiParameter(
                "peer", OpenApiTypes.STR, description="A peer address, or `*` for the aggregate keys."
            ),
            OpenApiParameter(
                "service", OpenApiTypes.STR, description="`tcp/443`, `udp/53`, `icmp`, `icmpv6`."
            ),
            OpenApiParameter("rule", OpenApiTypes.INT, description="A rule's lifetime number."),
            DIRECTION,
            *PAGE_PARAMETERS,
        ],
        responses={
            200: page_of("FlowWindowPage", FlowWindowSerializer()),
            **INVALID,
            **NOT_FOUND,
            **COMMON_ERRORS,
        },
    )
    def get(self, request):
        params = request.query_params
        (start, end), (cursor, limit), groups, _, direction = parsed_together(
            lambda: _range(request),
            lambda: page_params(request),
            lambda: validation.group_filters_parse(
                decision=params.get("decision"),
                peer=params.get("peer"),
                service=params.get("service"),
                rule=params.get("rule"),
            ),
            lambda: validation.workload_required(params.get("workload", "")),
            lambda: validation.direction_parse(params.get("direction")),
        )
        page = selectors.flow_windows_list(
            workload_id=params.get("workload", ""),
            start=start,
            end=end,
            cursor=cursor,
            limit=limit,
            groups=groups,
            direction=direction,
        )
        numbers = {group.rule_number for window in page.items for group in window.groups.all()}
        rule_ids = selectors.rule_ids_by_number(numbers)
        directions = direction != Direction.INBOUND
        return page_response(
            page, [flow_window_data(window, rule_ids, directions=directions) for window in page.items]
        )


class EvidenceGapListView(APIView):
    @extend_schema(
        operation_id="flows_gaps",
        parameters=[
            OpenApiParameter("workload", OpenApiTypes.UUID, many=True, description="Repeatable."),
            OpenApiParameter(
                "label", OpenApiTypes.STR, many=True, description="Label requirement; repeatable, ANDed."
            ),
            *RANGE,
            OpenApiParameter(
                "direction",
                OpenApiTypes.STR,
                enum=list(READ_DIRECTIONS),
                default=Direction.INBOUND,
                description="Checked as every flow read's; a gap loses evidence of both directions, so "
                "every value lists the same gaps.",
            ),
            *PAGE_PARAMETERS,
        ],
        responses={
            200: page_of("EvidenceGapPage", EvidenceGapSerializer()),
            **INVALID,
            **NOT_FOUND,
            **COMMON_ERRORS,
        },
    )
    def get(self, request):
        selection, (cursor, limit) = parsed_together(
            lambda: _selection(request), lambda: page_params(request)
        )
        page = selectors.evidence_gaps_list(
            workload_ids=selection.workload_ids,
            labels=selection.labels,
            start=selection.start,
            end=selection.end,
            cursor=cursor,
            limit=limit,
        )
        return page_response(page, [evidence_gap_data(gap) for gap in page.items])


SELECTION = [
    OpenApiParameter("workload", OpenApiTypes.UUID, many=True, description="Repeatable."),
    OpenApiParameter(
        "label", OpenApiTypes.STR, many=True, description="Label requirement; repeatable, ANDed."
    ),
]


def _selection(request) -> validation.FlowSelection:
    params = request.query_params
    return validation.flow_selection_parse(
        start=params.get("from"),
        end=params.get("to"),
        labels=params.getlist("label"),
        workloads=params.getlist("workload"),
        direction=params.get("direction"),
    )


def _selected(selection: validation.FlowSelection):
    return selectors.workloads_selected(workload_ids=selection.workload_ids, labels=selection.labels)


class FlowRollupView(APIView):
    @extend_schema(
        operation_id="flows_rollup",
        parameters=[
            OpenApiParameter(
                "group_by", OpenApiTypes.STR, many=True, required=True, enum=list(validation.GROUP_KEYS),
                description="Repeatable: the keys of each group.",
            ),
            *SELECTION,
            *RANGE,
            DIRECTION,
            *PAGE_PARAMETERS,
        ],
        responses={200: RollupSerializer, **INVALID, **NOT_FOUND, **COMMON_ERRORS},
    )  # fmt: skip
    def get(self, request):
        selection, (cursor, limit), group_by = parsed_together(
            lambda: _selection(request),
            lambda: page_params(request),
            lambda: validation.group_by_parse(request.query_params.getlist("group_by")),
        )
        rollup = selectors.flow_rollup_read(
            selected=_selected(selection),
            group_by=group_by,
            start=selection.start,
            end=selection.end,
            cursor=cursor,
            limit=limit,
            direction=selection.direction,
        )
        return Response(
            rollup_data(
                rollup.rows,
                rule_ids=rollup.rule_ids,
                next_cursor=rollup.next_cursor,
                coverage=coverage_data(rollup.coverage),
                unused_rules=rollup.unused_rules,
            )
        )

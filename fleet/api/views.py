"""Fleet endpoints: workloads, labels, rendered policy, resend-snapshot, revoke-credential, mode changes and
selector preview. Each handler parses, calls one domain function and renders."""

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api.responses import expected_version, page_params, page_response, versioned
from controlplane.api.schema import (
    COMMON_ERRORS,
    CONDITIONAL_ERRORS,
    IF_MATCH,
    PAGE_PARAMETERS,
    WRITE_ERRORS,
    page_of,
    problem,
)
from fleet import credentials, mode_confirmations, selectors, services
from fleet.api import schemas
from fleet.choices import Mode, SyncState
from fleet.representations import (
    labels_data,
    mode_change_data,
    mode_change_detail_data,
    rendered_policy_data,
    workload_data,
)

NOT_FOUND = {404: problem("`not-found`.")}
LIST_FILTERS = [
    OpenApiParameter(
        "label",
        OpenApiTypes.STR,
        many=True,
        description="Label requirement in the selector grammar; repeatable, ANDed.",
    ),
    OpenApiParameter(
        "id",
        OpenApiTypes.UUID,
        many=True,
        description="Workload id; repeatable: only these workloads (ANDed with the other filters). "
        "An id that names no workload is not listed; one that is not an id is a `validation` problem.",
    ),
    OpenApiParameter("sync_state", OpenApiTypes.STR, enum=SyncState.values),
    OpenApiParameter(
        "outbound_mode",
        OpenApiTypes.STR,
        enum=Mode.values,
        description="Only workloads whose outbound mode (judging the connections they open) is this.",
    ),
    OpenApiParameter(
        "removed", OpenApiTypes.BOOL, description="Only workloads whose owned table is (not) absent."
    ),
]


class WorkloadListView(APIView):
    @extend_schema(
        operation_id="workloads_list",
        parameters=LIST_FILTERS + PAGE_PARAMETERS,
        responses={200: schemas.WorkloadPage, **COMMON_ERRORS},
    )
    def get(self, request):
        filters = selectors.workload_filters_parse(
            labels=request.query_params.getlist("label"),
            sync_state=request.query_params.get("sync_state"),
            removed=request.query_params.get("removed"),
            ids=request.query_params.getlist("id"),
            outbound_mode=request.query_params.get("outbound_mode"),
        )
        cursor, limit = page_params(request)
        page = selectors.workload_list(**filters, cursor=cursor, limit=limit)
        return Response({"items": [workload_data(w) for w in page.items], "next_cursor": page.next_cursor})


class WorkloadCountsView(APIView):
    @extend_schema(operation_id="workloads_counts", responses={200: schemas.WorkloadCounts, **COMMON_ERRORS})
    def get(self, request):
        return Response(selectors.workload_counts())


class WorkloadView(APIView):
    @extend_schema(
        operation_id="workloads_get",
        responses={200: schemas.WorkloadSerializer, **NOT_FOUND, **COMMON_ERRORS},
    )
    def get(self, request, workload_id):
        return Response(workload_data(selectors.workload_get(workload_id=workload_id)))


class RenderedPolicyView(APIView):
    @extend_schema(
        operation_id="workloads_rendered_policy",
        responses={200: schemas.RenderedPolicySerializer, **NOT_FOUND, **COMMON_ERRORS},
    )
    def get(self, request, workload_id):
        workload = selectors.workload_get(workload_id=workload_id)
        return Response(rendered_policy_data(workload, workload.latest_policy))


class LabelsView(APIView):
    @extend_schema(
        operation_id="workloads_labels_get",
        responses={200: schemas.LabelsSerializer, **NOT_FOUND, **COMMON_ERRORS},
    )
    def get(self, request, workload_id):
        workload = selectors.workload_get(workload_id=workload_id)
        return versioned(labels_data(workload), workload.labels_version)

    @extend_schema(
        operation_id="workloads_labels_replace",
        parameters=[IF_MATCH],
        request=schemas.LabelsSerializer,
        responses={200: schemas.LabelsSerializer, **CONDITIONAL_ERRORS},
    )
    def put(self, request, workload_id):
        workload = services.workload_labels_replace(
            actor=request.user,
            workload_id=workload_id,
            expected_version=expected_version(request),
            data=request.data,
        )
        return versioned(labels_data(workload), workload.labels_version)


class ResendSnapshotView(APIView):
    @extend_schema(
        operation_id="workloads_resend_snapshot",
        request=None,
        responses={
            200: schemas.ResendSerializer,
            409: problem("`workload-offline`: carries `last_heard_from` (null: never connected)."),
            **NOT_FOUND,
            **WRITE_ERRORS,
        },
    )
    def post(self, request, workload_id):
        workload = services.workload_resend_snapshot(actor=request.user, workload_id=workload_id)
        return Response({"workload_id": str(workload.id), "directive": "sent"})


class RevokeCredentialView(APIView):
    @extend_schema(
        operation_id="workloads_revoke_credential",
        request=schemas.RevokeCredentialRequest,
        responses={200: schemas.WorkloadSerializer, **NOT_FOUND, **WRITE_ERRORS},
    )
    def post(self, request, workload_id):
        workload = credentials.credential_revoke(
            actor=request.user, workload_id=workload_id, data=request.data
        )
        return Response(workload_data(workload))


class ModeChangeView(APIView):
    @extend_schema(
        operation_id="mode_changes_list",
        parameters=[
            OpenApiParameter(
                "confirmation",
                OpenApiTypes.STR,
                enum=["awaiting", "confirmed", "reverted"],
                description="Only the mode changes whose confirmation is in this state (`awaiting`: "
                "the ones to confirm, or to be put back).",
            ),
            *PAGE_PARAMETERS,
        ],
        responses={
            200: page_of("ModeChangePage", schemas.ModeChangeSerializer()),
            422: problem("`validation`: a filter or paging parameter out of range."),
            **COMMON_ERRORS,
        },
    )
    def get(self, request):
        cursor, limit = page_params(request)
        page = selectors.mode_change_list(
            confirmation=request.query_params.get("confirmation"), cursor=cursor, limit=limit
        )
        return page_response(page, [mode_change_data(change) for change in page.items])

    @extend_schema(
        operation_id="mode_changes_create",
        request=schemas.ModeChangeRequest,
        responses={202: schemas.ModeChangeSerializer, **WRITE_ERRORS},
    )
    def post(self, request):
        intent = services.mode_change_create(actor=request.user, data=request.data)
        return Response(mode_change_data(intent), status=202)


class ModeChangeDetailView(APIView):
    @extend_schema(
        operation_id="mode_changes_get",
        responses={200: schemas.ModeChangeDetailSerializer, **NOT_FOUND, **COMMON_ERRORS},
    )
    def get(self, request, mode_change_id):
        return Response(mode_change_detail_data(selectors.mode_change_get(mode_change_id=mode_change_id)))


class ModeChangeConfirmView(APIView):
    @extend_schema(
        operation_id="mode_changes_confirm",
        request=None,
        responses={
            200: schemas.ModeChangeSerializer,
            **NOT_FOUND,
            409: problem(
                "`confirmation-deadline-passed`: the deadline passed unconfirmed (carries `confirm_by` "
                "and `reverted_by`); `no-confirmation-deadline`: the change has nothing to confirm."
            ),
            **WRITE_ERRORS,
        },
    )
    def post(self, request, mode_change_id):
        change = mode_confirmations.mode_change_confirm(actor=request.user, mode_change_id=mode_change_id)
        return Response(mode_change_data(change))


class SelectorPreviewView(APIView):
    @extend_schema(
        operation_id="selectors_preview",
        request=schemas.PreviewRequest,
        responses={200: schemas.PreviewSerializer, **WRITE_ERRORS},
    )
    def post(self, request):
        return Response(selectors.selector_preview_request(data=request.data))

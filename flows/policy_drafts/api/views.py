"""Draft policy endpoints: POST /policies/render-dryrun, /policies/impact, /policies/suggestions and
/policies/drafts (a draft saved, all or nothing). Each handler calls one domain function with the body
and renders its answer."""

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api.schema import COMMON_ERRORS, WRITE_ERRORS, problem
from flows.api.views import DIRECTION, INVALID, RANGE, SELECTION, _selected, _selection
from flows.api.views import NOT_FOUND as FLOWS_NOT_FOUND
from flows.policy_drafts import draft_save, dryrun, impact, review_now, suggestions
from flows.policy_drafts.api import schemas
from flows.representations import review_data

NOT_FOUND = {404: problem("`not-found`: no such workload.")}


class RenderDryrunView(APIView):
    @extend_schema(
        operation_id="policies_render_dryrun",
        request=schemas.DryrunRequest,
        responses={200: schemas.DryrunSerializer, **WRITE_ERRORS},
    )
    def post(self, request):
        return Response(dryrun.render_dryrun_request(data=request.data))


class PolicyImpactView(APIView):
    @extend_schema(
        operation_id="policies_impact",
        request=schemas.ImpactRequest,
        responses={200: schemas.ImpactSerializer, **WRITE_ERRORS, **NOT_FOUND},
    )
    def post(self, request):
        return Response(impact.policy_impact(data=request.data))


class PolicySuggestionsView(APIView):
    @extend_schema(
        operation_id="policies_suggestions",
        request=schemas.SuggestionRequestSerializer,
        responses={
            200: schemas.SuggestionSerializer,
            422: problem("`validation`: a bad range, selector, label key or prefix length."),
            **NOT_FOUND,
            **COMMON_ERRORS,
        },
    )
    def post(self, request):
        """Rules suggested from the stored flows no rule admitted (docs/policy.md, "Suggested rules").
        Saves nothing."""
        return Response(suggestions.policy_suggest_request(data=request.data))


class PolicyDraftSaveView(APIView):
    @extend_schema(
        operation_id="policies_drafts_save",
        request=schemas.DraftSaveRequest,
        responses={
            201: schemas.DraftSavedSerializer,
            **WRITE_ERRORS,
        },
    )
    def post(self, request):
        """Create a draft's services, address groups and rulesets (a suggestion's, edited or not) in one
        transaction: a refusal anywhere saves nothing, and its findings point into the draft."""
        return Response(draft_save.policy_draft_save(actor=request.user, data=request.data), status=201)


class SimulationReviewView(APIView):
    @extend_schema(
        operation_id="flows_review",
        parameters=[*SELECTION, *RANGE, DIRECTION],
        responses={200: schemas.ReviewNowSerializer, **INVALID, **FLOWS_NOT_FOUND, **COMMON_ERRORS},
    )
    def get(self, request):
        """The review before enforcing (docs/flows.md), judged on the decisions recorded, and `now`: a
        second verdict judging the recorded would-block groups against the policy in force now.
        Lives beside the draft policy reads because it uses their classifier."""
        selection = _selection(request)
        review = review_now.simulation_review_now(
            selected=_selected(selection),
            start=selection.start,
            end=selection.end,
            direction=selection.direction,
        )
        return Response(
            {**review_data(review), "judged_against": review["judged_against"], "now": review["now"]}
        )

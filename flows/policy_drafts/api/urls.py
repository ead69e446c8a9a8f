from django.urls import path

from flows.policy_drafts.api import views

urlpatterns = [
    path("policies/render-dryrun", views.RenderDryrunView.as_view()),
    path("policies/impact", views.PolicyImpactView.as_view()),
    path("flows/review", views.SimulationReviewView.as_view(), name="flows-review"),
    path("policies/drafts", views.PolicyDraftSaveView.as_view(), name="policies-drafts"),
    path("policies/suggestions", views.PolicySuggestionsView.as_view(), name="policies-suggestions"),
]

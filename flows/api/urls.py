from django.urls import path

from flows.api.views import (
    EvidenceGapListView,
    FlowRollupView,
    FlowWindowListView,
)

urlpatterns = [
    path("flows", FlowWindowListView.as_view(), name="flows"),
    path("flows/gaps", EvidenceGapListView.as_view(), name="flows-gaps"),
    path("flows/rollup", FlowRollupView.as_view(), name="flows-rollup"),
]

from django.urls import path

from flows.api.views import EvidenceGapListView, FlowWindowListView

urlpatterns = [
    path("flows", FlowWindowListView.as_view(), name="flows"),
    path("flows/gaps", EvidenceGapListView.as_view(), name="flows-gaps"),
]

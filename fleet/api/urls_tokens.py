"""Provisioning-token routes, included under /api/v1/ by controlplane/urls_operator.py."""

from django.urls import path

from fleet.api.provisioning_tokens import ProvisioningTokenListView, ProvisioningTokenView

urlpatterns = [
    path("provisioning-tokens", ProvisioningTokenListView.as_view(), name="provisioning-tokens"),
    path("provisioning-tokens/<uuid:token_id>", ProvisioningTokenView.as_view(), name="provisioning-token"),
]

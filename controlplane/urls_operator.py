"""The operator listener: the API under /api/v1, Prometheus metrics at /metrics and the console at /."""

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from controlplane.api.audit import AuditEventListView
from controlplane.api.errors import handler400, handler403, handler404, handler500  # noqa: F401
from controlplane.api.metrics import MetricsView
from controlplane.api.operator_tokens import OperatorTokenListView, OperatorTokenView
from controlplane.api.session import MeView, SessionView
from controlplane.api.webhooks import WebhookDeliveryListView, WebhookListView, WebhookView

api_v1 = [
    path("session", SessionView.as_view(), name="session"),
    path("me", MeView.as_view(), name="me"),
    path("operator-tokens", OperatorTokenListView.as_view(), name="operator-tokens"),
    path("operator-tokens/<uuid:token_id>", OperatorTokenView.as_view(), name="operator-token"),
    path("audit-events", AuditEventListView.as_view(), name="audit-events"),
    path("webhooks", WebhookListView.as_view(), name="webhooks"),
    path("webhooks/<uuid:webhook_id>", WebhookView.as_view(), name="webhook"),
    path(
        "webhooks/<uuid:webhook_id>/deliveries", WebhookDeliveryListView.as_view(), name="webhook-deliveries"
    ),
    path("", include("policy.api.urls")),
    path("", include("fleet.api.urls")),
    path("", include("fleet.api.urls_tokens")),
    path("", include("flows.api.urls")),
    path("", include("flows.policy_drafts.api.urls")),
    path("schema", SpectacularAPIView.as_view(), name="schema"),
    path("docs", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("redoc", SpectacularRedocView.as_view(url_name="schema"), name="redoc"),
]

urlpatterns = [
    path("api/v1/", include(api_v1)),
    path("metrics", MetricsView.as_view(), name="metrics"),  # Prometheus's default path; docs/metrics.md
    path("", include("controlplane.console.urls")),
]

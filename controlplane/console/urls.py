"""The console at /: pages that read and write through the operator API only."""

from django.urls import path, re_path

from controlplane.console.views import evidence, fleet, policy, session, suggest, tokens, webhooks

urlpatterns = [
    path("login", session.login),
    path("logout", session.logout),
    path("", fleet.fleet),
    path("workloads/<str:workload_id>", fleet.workload),
    path("workloads/<str:workload_id>/labels", fleet.workload_labels),
    path("workloads/<str:workload_id>/resend-snapshot", fleet.workload_resend),
    path("workloads/<str:workload_id>/revoke-credential", fleet.workload_revoke_credential),
    path("policy", policy.policy_index),
    path("policy/suggest", suggest.suggest),
    path("policy/rulesets/new", policy.ruleset_new),
    path("policy/rulesets/<str:ruleset_id>", policy.ruleset_detail),
    path("policy/rulesets/<str:ruleset_id>/delete", policy.ruleset_delete),
    path("policy/rulesets/<str:ruleset_id>/rules/new", policy.rule_edit),
    path("policy/rulesets/<str:ruleset_id>/rules/<str:rule_id>", policy.rule_edit),
    path("policy/rulesets/<str:ruleset_id>/rules/<str:rule_id>/delete", policy.rule_delete),
    re_path(r"^policy/(?P<kind>services|address-groups)/new$", policy.named_edit),
    re_path(r"^policy/(?P<kind>services|address-groups)/(?P<object_id>[^/]+)$", policy.named_edit),
    re_path(r"^policy/(?P<kind>services|address-groups)/(?P<object_id>[^/]+)/delete$", policy.named_delete),
    path("policy/selector-preview", policy.selector_preview),
    path("mode-changes", evidence.mode_changes),
    path("mode-changes/convergence", evidence.convergence),
    path("mode-changes/<str:mode_change_id>", evidence.mode_change),
    path("mode-changes/<str:mode_change_id>/confirm", evidence.mode_change_confirm),
    path("review", evidence.review),
    path("flows", evidence.flows),
    path("tokens", tokens.tokens),
    re_path(r"^tokens/(?P<kind>provisioning|operator)/(?P<token_id>[^/]+)/revoke$", tokens.token_revoke),
    path("webhooks", webhooks.webhooks),
    path("webhooks/<str:webhook_id>", webhooks.webhook_detail),
    path("webhooks/<str:webhook_id>/delete", webhooks.webhook_delete),
    path("about", tokens.about),
    # Any other path outside the API and the static files: the console's own "not found" page.
    re_path(r"^(?!api/|static/).*$", fleet.page_not_found),
]

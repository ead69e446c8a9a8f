from django.apps import AppConfig


class PolicyDraftsConfig(AppConfig):
    name = "flows.policy_drafts"
    label = "policy_drafts"
    verbose_name = "Draft policy"

from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "controlplane.webhooks"
    label = "webhooks"
    verbose_name = "Webhooks"
    default_auto_field = "django.db.models.BigAutoField"

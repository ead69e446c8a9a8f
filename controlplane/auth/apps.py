from django.apps import AppConfig


class OperatorAuthConfig(AppConfig):
    name = "controlplane.auth"
    label = "operator_auth"
    verbose_name = "Operator authentication"

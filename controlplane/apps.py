from django.apps import AppConfig


class ControlPlaneConfig(AppConfig):
    name = "controlplane"
    verbose_name = "Palisade control plane"

    def ready(self):
        from controlplane.outage import watch_connections

        watch_connections()

from django.apps import AppConfig


class ControlPlaneConfig(AppConfig):
    name = "controlplane"
    verbose_name = "Palisade control plane"

    def ready(self):
        from controlplane import metrics
        from controlplane.metrics_collector import FleetCollector
        from controlplane.outage import watch_connections
        from fleet import held_streams

        watch_connections()
        # The fleet's figures, read at each scrape, and the streams this process holds, beside the
        # instruments the code counts with (docs/metrics.md).
        metrics.REGISTRY.register(FleetCollector())
        metrics.STREAMS_HELD.set_function(lambda: len(held_streams.open_streams))

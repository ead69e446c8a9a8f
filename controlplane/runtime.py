"""Facts about the running service that only `serve` knows once it has started: the ports of its
listeners, the gateway's address and the fingerprint of the certificate it serves, and what the
command line said about them. Kept here, not written into django.conf.settings at run time; outside
`serve` (commands, tests) they keep their defaults, which come from the settings (the environment).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from django.conf import settings


@dataclass(frozen=True)
class Facts:
    listener_ports: dict[int, str] = field(default_factory=dict)
    gateway_host: str = ""  # "" until serve listens: the host name is used
    gateway_port: int = 8443
    # The gateways agents are given, in order; None: the environment's PALISADE_GATEWAY_ADVERTISE
    # (comma-separated).
    gateway_advertise: tuple[str, ...] | None = None
    gateway_fingerprint: str = ""  # "" outside serve: the one serve recorded in the database
    site_label: str | None = None  # None: the environment's PALISADE_SITE_LABEL
    flow_retention_days: int | None = None  # None: the environment's PALISADE_FLOW_RETENTION_DAYS

    @property
    def advertised(self) -> tuple[str, ...]:
        if self.gateway_advertise is not None:
            return self.gateway_advertise
        return tuple(a.strip() for a in settings.PALISADE_GATEWAY_ADVERTISE.split(",") if a.strip())

    @property
    def retention_days(self) -> int:
        return (
            settings.PALISADE_FLOW_RETENTION_DAYS
            if self.flow_retention_days is None
            else self.flow_retention_days
        )

    @property
    def label(self) -> str:
        return settings.PALISADE_SITE_LABEL if self.site_label is None else self.site_label


facts = Facts()


def facts_set(**changes) -> Facts:
    """Replace some facts (serve at start; tests). Readers always see one consistent set."""
    global facts
    facts = replace(facts, **changes)
    return facts


def facts_reset() -> None:
    global facts
    facts = Facts()

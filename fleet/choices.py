"""The fleet's vocabulary: one definition each, used by the models, the API schema, the command line
and the code (the pure renderer and the agent keep plain copies, checked equal by the tests)."""

from django.db import models


class Mode(models.TextChoices):
    VISIBILITY = "visibility"
    SIMULATION = "simulation"
    ENFORCED = "enforced"


class SyncState(models.TextChoices):
    SYNCED = "synced"
    PENDING = "pending"
    DEGRADED = "degraded"
    OFFLINE = "offline"


class OwnedTableState(models.TextChoices):
    """Whether the agent last saw Palisade's nftables table in the kernel."""

    PRESENT = "present"
    ABSENT = "absent"
    UNKNOWN = "unknown"

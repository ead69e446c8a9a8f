"""The vocabulary of flow evidence (spec: "Stored flow window", "Evidence gap kinds")."""

from django.db import models


class Decision(models.TextChoices):
    OBSERVED = "observed"
    ALLOWED = "allowed"
    WOULD_BLOCK = "would_block"
    BLOCKED = "blocked"


class GapKind(models.TextChoices):
    SOURCE_OVERRUN = "source_overrun"
    SOURCE_RESTART = "source_restart"
    BUFFER_OVERFLOW = "buffer_overflow"
    DUMP_TRUNCATED = "dump_truncated"
    WINDOW_OVERFLOW = "window_overflow"
    WINDOW_REJECTED = "window_rejected"
    TABLE_REMOVED = "table_removed"
    AGENT_SILENT = "agent_silent"  # the control plane's own: an agent cannot report it


class GapSource(models.TextChoices):
    CONNTRACK = "conntrack"
    NFLOG = "nflog"


AGENT_GAP_KINDS = tuple(kind for kind in GapKind.values if kind != GapKind.AGENT_SILENT)

# The longest window an agent may report (`--flow-window-seconds`). A window that ends after an instant
# starts less than this before it, which is what lets a range read skip older day partitions.
MAX_WINDOW_SECONDS = 3600

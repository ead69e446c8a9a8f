"""The vocabulary of flow evidence (spec: "Stored flow window", "Evidence gap kinds")."""

from django.db import models


class Decision(models.TextChoices):
    OBSERVED = "observed"
    ALLOWED = "allowed"
    WOULD_BLOCK = "would_block"
    BLOCKED = "blocked"


class Direction(models.TextChoices):
    """Who originated a connection: a peer (inbound, all evidence before outbound existed) or the
    workload itself (outbound). A read takes `any` besides these (READ_DIRECTIONS)."""

    INBOUND = "inbound"
    OUTBOUND = "outbound"


ANY_DIRECTION = "any"
READ_DIRECTIONS = (*Direction.values, ANY_DIRECTION)


class GapKind(models.TextChoices):
    SOURCE_OVERRUN = "source_overrun"
    SOURCE_RESTART = "source_restart"
    BUFFER_OVERFLOW = "buffer_overflow"
    DUMP_TRUNCATED = "dump_truncated"
    WINDOW_OVERFLOW = "window_overflow"
    WINDOW_REJECTED = "window_rejected"
    TABLE_REMOVED = "table_removed"
    # Beyond the spec's kinds: another process edited the owned table, from the agent's detection to its
    # restoring the applied document; what the kernel decided meanwhile followed someone else's rules.
    TABLE_MODIFIED = "table_modified"
    AGENT_SILENT = "agent_silent"  # the control plane's own: an agent cannot report it
    # Beyond the spec's kinds: a window held more distinct keys than are kept one by one, and those
    # over the bound were summed into its aggregate keys (below). Counts are whole; which peers,
    # services and rules those connections had is what was lost. The agent reports it (at
    # `--flow-window-keys`), and the control plane does (past PALISADE_FLOW_WINDOW_MAX_KEYS a window,
    # PALISADE_FLOW_REPORT_MAX_KEYS a report).
    KEYS_AGGREGATED = "keys_aggregated"


class GapSource(models.TextChoices):
    CONNTRACK = "conntrack"
    NFLOG = "nflog"


AGENT_GAP_KINDS = tuple(kind for kind in GapKind.values if kind != GapKind.AGENT_SILENT)

# A window's aggregate key: one per decision and direction, holding the connections of the keys over the bound. Its
# peer and protocol are this mark, never an address or a protocol (no real key has them), its port
# 0 and its rule none. Reads show it as it is stored; no rule may be proposed from it.
AGGREGATE = "*"

# The longest window an agent may report (`--flow-window-seconds`). A window that ends after an instant
# starts less than this before it, which is what lets a range read skip older day partitions.
MAX_WINDOW_SECONDS = 3600

"""Stored flow evidence: windows (one row per agent window, its groups as rows) and evidence gaps.
On PostgreSQL the three tables are partitioned by day (flows/partitions.py, migration 0002).

Ids are the agent's own, so a window or gap re-sent after a lost acknowledgement is stored once.
"""

from django.db import models

from fleet.models import Workload
from flows.choices import Decision, Direction, GapKind, GapSource


class FlowWindow(models.Model):
    id = models.UUIDField(primary_key=True)  # given by the agent when the window opened
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="+")
    start = models.DateTimeField()
    end = models.DateTimeField()
    policy_version = models.CharField(max_length=80, blank=True)
    accounting = models.BooleanField()  # bytes counted (nf_conntrack_acct=1), or not counted at all
    received_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["workload", "start", "id"], name="flow_window_order")]


class FlowCounters(models.Model):
    """A key (peer, service, decision, direction) and its counters, as groups and hourly sums both hold them."""

    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="+")
    peer = models.CharField(max_length=45)
    peer_workload = models.ForeignKey(Workload, on_delete=models.SET_NULL, null=True, related_name="+")
    protocol = models.CharField(max_length=8)
    port = models.PositiveIntegerField()
    decision = models.CharField(max_length=16, choices=Decision.choices)
    # Who originated the connection (the rows from before outbound evidence are all inbound), and
    # whether the fail-safe list (DNS, NTP) admitted it instead of a rule: both part of the key.
    direction = models.CharField(
        max_length=8, choices=Direction.choices, default=Direction.INBOUND, db_default=Direction.INBOUND
    )
    failsafe = models.BooleanField(default=False, db_default=False)
    connection_count = models.PositiveBigIntegerField()
    first_seen = models.DateTimeField()
    last_seen = models.DateTimeField()
    bytes_in = models.PositiveBigIntegerField()
    bytes_out = models.PositiveBigIntegerField()

    class Meta:
        abstract = True


class FlowGroup(FlowCounters):
    """One key of a window, with its counters."""

    id = models.BigAutoField(primary_key=True)
    # No database constraint: on PostgreSQL both tables are partitioned by start (flows/partitions.py),
    # so a window's id alone is not a key the database can reference; they are dropped together.
    window = models.ForeignKey(
        FlowWindow, on_delete=models.CASCADE, related_name="groups", db_constraint=False
    )
    # The window's start and end (and workload), repeated: rollups read this table alone, with no join.
    start = models.DateTimeField()
    end = models.DateTimeField()
    rule_number = models.PositiveIntegerField(null=True)

    class Meta:
        indexes = [
            models.Index(fields=["workload", "start"], name="flow_group_workload_start"),
            # The edges of a rollup's range: an hour or two of every workload's rows.
            models.Index(fields=["start"], name="flow_group_start"),
        ]


# What a row of sums is the sum of, beside its workload and its span: one key of the windows.
SUMS_KEY = ("peer", "protocol", "port", "decision", "rule_number", "direction", "failsafe")


class FlowSums(FlowCounters):
    """The groups of one workload's windows that start in one span, summed per key. Written by
    serve's housekeeping a few minutes after each ten-minute block is over
    (flows.sums.writes.flow_windows_sum), not by ingestion."""

    id = models.BigAutoField(primary_key=True)
    rule_number = models.PositiveIntegerField()  # 0: no rule decided (a key column, so never null)
    # Summing updates rows in place (an hour's once a block, any row for a window that arrived late).
    # No index of their own on these two: the key's unique index leads with the workload, and nothing
    # looks rows up by peer workload; an update that touches no indexed column can stay on its page (a
    # HOT update, flows/partitions.py).
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="+", db_index=False)
    peer_workload = models.ForeignKey(
        Workload, on_delete=models.SET_NULL, null=True, related_name="+", db_index=False
    )

    class Meta:
        abstract = True


class FlowHour(FlowSums):
    """Sums over an hour: what a rollup reads for the whole hours of its range (ten-minute sums and
    minute rows only at its edges, and the minute rows of windows not summed yet). Each row is written
    six times an hour instead of once a minute per workload."""

    hour = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["workload", "hour", *SUMS_KEY],
                name="flow_hour_key",
            )
        ]
        # A rollup of the whole fleet reads its hours by hour alone. Updates never change `hour`, so
        # they stay HOT.
        indexes = [models.Index(fields=["hour"], name="flow_hour_start")]


class FlowQuarter(FlowSums):
    """Sums over a quarter of a day (six hours from midnight UTC): what a rollup reads for the whole
    quarters of its range, hours and blocks beside them. A day's range of a thousand workloads is then
    about three quarters' rows and a few hours' per key, not twenty-four hours'. Written with the other
    sums, from the same windows, in the same transaction."""

    quarter = models.DateTimeField()  # its start: 00:00, 06:00, 12:00 or 18:00 UTC

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["workload", "quarter", *SUMS_KEY],
                name="flow_quarter_key",
            )
        ]
        indexes = [models.Index(fields=["quarter"], name="flow_quarter_start")]


class FlowBlock(FlowSums):
    """Sums over ten-minute blocks: what a rollup reads for the whole blocks in the part-hours at its
    range's edges, so that it reads at most ten minutes of minute rows on each side (a day's range
    ending now is otherwise up to an hour of every selected workload's minute rows). Written with the
    hourly sums, from the same windows, in the same transaction."""

    block = models.DateTimeField()  # its start: a multiple of ten minutes

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["workload", "block", *SUMS_KEY],
                name="flow_block_key",
            )
        ]
        # A rollup reads a few blocks at each edge of its range, of a day's: by block, not the day.
        indexes = [models.Index(fields=["block"], name="flow_block_start")]


class UnsummedWindow(models.Model):
    """A stored window whose groups are not in the sums yet: written with the window, removed in the
    transaction that adds its groups to their hour and block. Rollups read these windows' groups
    themselves, so a total never depends on whether summing has run."""

    window_id = models.UUIDField(primary_key=True)
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="+", db_index=False)
    start = models.DateTimeField()
    # Its groups: summing takes windows up to a number of groups per transaction, not of windows
    # (0: a window stored before this was counted).
    keys = models.PositiveIntegerField(default=0)

    class Meta:
        indexes = [
            models.Index(fields=["start"], name="unsummed_window_start"),
            models.Index(fields=["workload", "start"], name="unsummed_window_order"),
        ]


class EvidenceGap(models.Model):
    id = models.UUIDField(primary_key=True)  # the agent's, or the control plane's for agent_silent
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=24, choices=GapKind.choices)
    source = models.CharField(max_length=16, choices=GapSource.choices, null=True)
    start = models.DateTimeField()
    end = models.DateTimeField()
    lost = models.JSONField(default=dict)  # what was lost where known: events, keys, windows
    received_at = models.DateTimeField()

    class Meta:
        indexes = [
            models.Index(fields=["workload", "start", "id"], name="evidence_gap_order"),
            models.Index(fields=["start", "id"], name="evidence_gap_start"),
        ]

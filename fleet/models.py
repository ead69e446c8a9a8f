"""Workloads, their rendered policies, provisioning tokens and mode-change intents."""

import functools
import uuid
from typing import NamedTuple

from django.db import connection, models

from fleet.choices import Mode, OwnedTableState, SyncState


class RenderedPolicy(models.Model):
    """One rendered nftables document, stored once however many workloads share it."""

    version = models.CharField(max_length=80, primary_key=True)  # content hash of the document
    document = models.TextField()
    rule_index = models.JSONField(default=dict)
    created_at = models.DateTimeField()


class ProvisioningToken(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    description = models.CharField(max_length=1000)
    prefix = models.CharField(max_length=16)
    digest = models.CharField(max_length=64, unique=True)
    labels = models.JSONField(default=dict)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True)
    max_uses = models.PositiveIntegerField(null=True)
    uses = models.PositiveIntegerField(default=0)
    last_used_at = models.DateTimeField(null=True)
    revoked_at = models.DateTimeField(null=True)
    # Minted for re-enrolling this one workload (one use; it enrols nothing else); null: a general
    # token, which creates new workloads and re-enrols none. Cascades: a token whose workload is gone
    # must never become a general one.
    workload = models.ForeignKey("Workload", on_delete=models.CASCADE, null=True, related_name="+")

    class Meta:
        indexes = [models.Index(fields=["created_at", "id"], name="provisioning_token_order")]


class Workload(models.Model):
    # Fleet order: what needs attention first, then the rest by how far from converged.
    RANK_ATTENTION, RANK_OFFLINE, RANK_PENDING, RANK_SYNCED = 0, 1, 2, 3

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    hostname = models.CharField(max_length=255)
    addresses = models.JSONField(default=list)
    labels = models.JSONField(default=dict)
    labels_version = models.PositiveBigIntegerField(default=1)
    mode = models.CharField(max_length=16, choices=Mode.choices, default=Mode.VISIBILITY)
    # When the current mode was chosen (a mode change's instant); null: since enrolment.
    mode_since = models.DateTimeField(null=True)
    # The latest mode change that selected it (whether or not its mode moved): a change awaiting
    # confirmation reverts only the workloads it still holds. Null: none since enrolment.
    mode_change = models.ForeignKey(
        "ModeChange", on_delete=models.SET_NULL, null=True, related_name="+", db_index=False
    )
    # The mode judging the connections it opens (docs/policy.md, outbound); visibility installs nothing.
    outbound_mode = models.CharField(max_length=16, choices=Mode.choices, default=Mode.VISIBILITY)
    outbound_mode_since = models.DateTimeField(null=True)
    # As mode_change, for the outbound mode: the two directions are put back independently.
    outbound_mode_change = models.ForeignKey(
        "ModeChange", on_delete=models.SET_NULL, null=True, related_name="+", db_index=False
    )
    latest_policy = models.ForeignKey(RenderedPolicy, on_delete=models.PROTECT, null=True, related_name="+")
    # When the latest version last moved: the time to the agent's first acknowledgement of it is a
    # metric (controlplane/metrics.py). Null: before this was recorded.
    latest_version_at = models.DateTimeField(null=True)
    applied_version = models.CharField(max_length=80, blank=True)
    agent_version = models.CharField(max_length=64, blank=True)

    sync_state = models.CharField(max_length=16, choices=SyncState.choices, default=SyncState.OFFLINE)
    sync_error = models.TextField(blank=True)
    stream_id = models.CharField(max_length=64, blank=True)  # the open stream; empty when none
    # The gateway (HOST:PORT, as the agent's list names it) the agent dialed for its last stream; shown
    # while that stream is open. Empty from agents that know one gateway.
    stream_gateway = models.CharField(max_length=300, blank=True, default="")
    last_snapshot_sent_at = models.DateTimeField(null=True)
    # A resend asked for and not yet answered by a snapshot, which clears it (fleet.streams); no clock
    # comparison, so a host command on a machine whose clock runs ahead cannot repeat it forever.
    resend_requested_at = models.DateTimeField(null=True)
    last_heard_from = models.DateTimeField(null=True)  # null: never connected
    owned_table_state = models.CharField(
        max_length=16, choices=OwnedTableState.choices, default=OwnedTableState.UNKNOWN
    )
    # The last hand edit of the owned table the agent saw and put right (`table_modified` on the stream):
    # when it saw it (agent clock), when its document was back (null: the restore failed), what differed.
    table_modified_at = models.DateTimeField(null=True)
    table_restored_at = models.DateTimeField(null=True)
    table_modification = models.CharField(max_length=500, blank=True)
    last_flow_report_at = models.DateTimeField(null=True)
    # From flow reports (flows/services.py): the agent's clock offset when over two windows, and the
    # latest evidence gap, so a fleet read shows both without reading the flow tables.
    clock_skew_seconds = models.FloatField(null=True)
    clock_skew_seen_at = models.DateTimeField(null=True)
    last_gap_kind = models.CharField(max_length=24, blank=True)
    last_gap_start = models.DateTimeField(null=True)
    last_gap_end = models.DateTimeField(null=True)
    # The agent process that sent the last flow report, and the last time it was known alive (a report
    # or a heartbeat of that process): a report from another process after a silence yields agent_silent.
    flow_process_start_id = models.CharField(max_length=64, blank=True)
    flow_process_alive_at = models.DateTimeField(null=True)
    # The uptime in that process's latest report, and the processes that reported before it (newest
    # first, one a line): a report no newer than these (a replay, a late one of an older process) is
    # stored but moves neither liveness nor the clock skew.
    flow_process_uptime_seconds = models.FloatField(null=True)
    flow_processes_before = models.TextField(blank=True)
    # The longest window it ever reported (seconds): how long before a range one of its windows that
    # reaches into the range can start, so reads look back that far and not the hour windows may last.
    flow_window_seconds_longest = models.PositiveIntegerField(default=0)
    # The window of its latest report: telemetry is live while a report arrived within two of them.
    flow_window_seconds = models.PositiveIntegerField(default=0)
    # From the stream's heartbeats: the start (agent clock) of the oldest flow window or gap the agent
    # holds unacknowledged (reports held back while the stream is up); null when none, or no stream.
    flow_backlog_since = models.DateTimeField(null=True)
    rank = models.PositiveSmallIntegerField(default=RANK_OFFLINE)

    public_key = models.CharField(max_length=64)  # Ed25519, base64
    credential_serial = models.PositiveBigIntegerField(default=1)
    credential_issued_at = models.DateTimeField()
    credential_expires_at = models.DateTimeField()
    credential_renewal_failed = models.BooleanField(default=False)
    credential_last_error = models.TextField(blank=True)
    credential_last_late_renewal = models.DateTimeField(null=True)
    # How long past its expiry that renewal came (the console's 'renewed N late').
    credential_last_late_by_seconds = models.PositiveIntegerField(null=True)
    # Revoked by the operator (fleet.credentials.credential_revoke): no stream, report or renewal
    # until a re-enrolment with a token minted for this workload clears it.
    credential_revoked_at = models.DateTimeField(null=True)
    credential_revoked_reason = models.CharField(max_length=1000, blank=True)

    enrolled_at = models.DateTimeField()
    enrolled_with = models.ForeignKey(
        ProvisioningToken, on_delete=models.SET_NULL, null=True, related_name="+"
    )

    class Meta:
        indexes = [
            models.Index(fields=["rank", "hostname", "id"], name="workload_fleet_order"),
            models.Index(fields=["sync_state", "owned_table_state"], name="workload_counts"),
            # The latest enrolment: flow ingestion's check that its address -> workload map is current.
            models.Index(fields=["enrolled_at"], name="workload_enrolled_at"),
        ]


class ModeChange(models.Model):
    """An intent: move a selection of workloads to a mode. Convergence is read off the workloads
    (applied vs latest version), never tracked here.

    An operator's intent may carry a deadline (`confirm_by`): unless confirmed by then, the system
    puts its workloads back (fleet/mode_confirmations.py) with an intent of its own, which names the
    one it `reverts` and gives its `reason`."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    actor = models.CharField(max_length=200)
    created_at = models.DateTimeField()
    selection = models.JSONField()
    # Which mode it moves (and its ModeChangeWorkload rows record): the inbound one or the outbound one.
    direction = models.CharField(max_length=8, default="inbound")
    # Null only for a revert that put its workloads back into different modes (each one's is in its
    # ModeChangeWorkload rows).
    mode = models.CharField(max_length=16, choices=Mode.choices, null=True)
    resolved_count = models.PositiveIntegerField()
    changed_count = models.PositiveIntegerField()
    confirm_by = models.DateTimeField(null=True)  # null: nothing to confirm
    confirmed_at = models.DateTimeField(null=True)
    confirmed_by = models.CharField(max_length=300, blank=True)  # the confirming actor's label
    reverted_at = models.DateTimeField(null=True)  # the deadline passed unconfirmed: reverted then
    # A system intent: the change it put back (one revert per change, at most: the database says so too).
    reverts = models.OneToOneField(
        "self", on_delete=models.PROTECT, null=True, related_name="revert", db_index=False
    )
    reason = models.CharField(max_length=300, blank=True)  # why the system made this intent
    # A revert: the workloads of the change it put back that a later change had taken over, left as
    # they were: [{"workload_id", "mode", "moved_by"}].
    left_alone = models.JSONField(default=list)

    class Meta:
        indexes = [
            models.Index(fields=["created_at", "id"], name="mode_change_order"),
            # Housekeeping's question every second: which deadlines passed unconfirmed?
            models.Index(
                fields=["confirm_by"],
                name="mode_change_awaiting",
                condition=models.Q(
                    confirm_by__isnull=False, confirmed_at__isnull=True, reverted_at__isnull=True
                ),
            ),
        ]


class ModeChangeWorkload(models.Model):
    """One workload of a change that has a deadline, or of a revert: the mode it had before and the
    mode the change set. For a change awaiting confirmation, `mode_before` is what its revert puts
    back: the workload's mode, or, when an earlier change awaiting confirmation held it, the mode that
    one would have put back (a chain of unconfirmed changes goes back to where it started)."""

    mode_change = models.ForeignKey(ModeChange, on_delete=models.CASCADE, related_name="workloads")
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="+", db_index=False)
    mode_before = models.CharField(max_length=16, choices=Mode.choices)
    mode_after = models.CharField(max_length=16, choices=Mode.choices)
    # Which of the workload's modes these are (its change's direction): a revert puts that one back.
    direction = models.CharField(max_length=8, default="inbound")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["mode_change", "workload"], name="mode_change_workload_once"),
        ]


def workload_column_value(field: str, value):
    """`value` as the database stores `field` of a workload, for the few hot statements written in
    SQL (a UUID is 32 hex digits on SQLite; datetimes are naive UTC there)."""
    return Workload._meta.get_field(field).get_db_prep_value(value, connection)


class WorkloadReading(NamedTuple):
    """How a hot read written in SQL selects workload rows and makes them the ORM's instances."""

    columns: str  # for SELECT, in the model's order of fields, which `Workload.from_db` expects
    names: tuple[str, ...]  # their attribute names
    converters: tuple  # (position, conversion) of the values the ORM converts from the database


@functools.lru_cache(maxsize=64)
def workload_reading(vendor: str, fields: tuple[str, ...] | None = None) -> WorkloadReading:
    """The reading of `fields` (every field when None) on the `vendor`'s database: building the ORM's
    query cost more CPU than running it, on paths that run hundreds of times a second (a report's
    write, a stream's authentication when a failover brings thousands at once)."""
    chosen = [f for f in Workload._meta.concrete_fields if fields is None or f.name in fields]
    converters = []
    for index, field in enumerate(chosen):
        column = field.get_col(Workload._meta.db_table)
        found = connection.ops.get_db_converters(column) + column.get_db_converters(connection)
        if found:
            converters.append((index, functools.partial(_converted, found, column)))
    return WorkloadReading(
        ", ".join(f'"{f.column}"' for f in chosen), tuple(f.attname for f in chosen), tuple(converters)
    )


def workload_from_row(reading: WorkloadReading, row) -> Workload:
    """The instance the ORM would make of `row`, read with `reading`'s columns."""
    values = list(row)
    for index, convert in reading.converters:
        values[index] = convert(values[index])
    return Workload.from_db(connection.alias, reading.names, values)


def _converted(converters: list, column, value):
    # Each thread has a connection of its own: the converters run with the one at hand.
    for convert in converters:
        value = convert(value, column, connection)
    return value

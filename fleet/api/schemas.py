"""OpenAPI shapes of fleet reads and writes (documentation only)."""

from drf_spectacular.utils import inline_serializer
from rest_framework import serializers

from fleet.choices import Mode, OwnedTableState, SyncState
from fleet.mode_confirmations import CONFIRM_WITHIN_MAX, CONFIRM_WITHIN_MIN
from policy.choices import Direction


class SyncSerializer(serializers.Serializer):
    state = serializers.ChoiceField(choices=SyncState.values)
    last_snapshot_sent_at = serializers.DateTimeField(allow_null=True)
    last_heard_from = serializers.DateTimeField(allow_null=True, help_text="null: never connected.")
    never_connected = serializers.BooleanField()
    gateway = serializers.CharField(
        allow_null=True,
        help_text=(
            "The gateway (host:port, as the agent's list of gateways names it) the open stream is "
            "connected to; null without a stream, or from an agent that knows a single gateway."
        ),
    )
    error = serializers.CharField(allow_null=True, help_text="The agent's error while `degraded`.")
    pending_version = serializers.CharField(
        allow_null=True, help_text="The version not yet applied while `pending`."
    )


class CredentialSerializer(serializers.Serializer):
    state = serializers.ChoiceField(choices=["renews", "renewal-failed", "expired"])
    expires_at = serializers.DateTimeField()
    renewal_due_at = serializers.DateTimeField()
    last_error = serializers.CharField(allow_null=True)
    last_late_renewal = serializers.DateTimeField(
        allow_null=True, help_text="Set by a renewal made after expiry."
    )
    last_late_renewal_late_by_seconds = serializers.IntegerField(
        allow_null=True, help_text="How long after the expiry that renewal came ('renewed N late')."
    )
    revoked = inline_serializer(
        "CredentialRevocation",
        {
            "at": serializers.DateTimeField(),
            "reason": serializers.CharField(allow_null=True, help_text="The operator's reason, if given."),
        },
        allow_null=True,
        help_text="Set while the operator's revocation stands (POST /workloads/{id}/revoke-credential): "
        "the workload's streams, renewals, flow reports and key-signed re-enrolments are refused, whatever "
        "`state` says, until it is re-enrolled with a provisioning token minted for it. null: not revoked.",
    )


class HealthSerializer(serializers.Serializer):
    telemetry_live = serializers.BooleanField(
        help_text="A flow report arrived within two of the workload's flow windows (as its latest report states)."
    )
    clock_skew = inline_serializer(
        "ClockSkew",
        {
            "offset_seconds": serializers.FloatField(help_text="Agent clock minus the control plane's."),
            "seen_at": serializers.DateTimeField(),
        },
        allow_null=True,
        help_text="Set while the latest flow report showed the agent's clock off by more than two windows.",
    )
    evidence_gap = inline_serializer(
        "LatestEvidenceGap",
        {
            "kind": serializers.CharField(),
            "start": serializers.DateTimeField(),
            "end": serializers.DateTimeField(),
        },
        allow_null=True,
        help_text="The workload's most recent evidence gap (GET /flows/gaps lists them all).",
    )
    owned_table = inline_serializer(
        "OwnedTable",
        {
            "state": serializers.ChoiceField(choices=OwnedTableState.values),
            "modified_at": serializers.DateTimeField(
                allow_null=True,
                help_text="When the agent last saw another process edit its table (agent clock); null: never.",
            ),
            "restored_at": serializers.DateTimeField(
                allow_null=True,
                help_text="When the agent put its applied document back after that edit; null: never "
                "edited, or the restore failed.",
            ),
            "modification": serializers.CharField(
                allow_null=True,
                help_text='What differed, e.g. "chain input: 1 rule added; set allow_v4_3: 1 element added".',
            ),
        },
    )
    credential = CredentialSerializer()


class WorkloadSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    hostname = serializers.CharField()
    addresses = serializers.ListField(child=serializers.IPAddressField())
    labels = serializers.DictField(child=serializers.CharField())
    labels_version = serializers.CharField()
    mode = serializers.ChoiceField(choices=Mode.values)
    mode_since = serializers.DateTimeField(
        help_text="When the current mode was chosen (the mode change, or the enrolment)."
    )
    outbound_mode = serializers.ChoiceField(
        choices=Mode.values,
        help_text="The mode judging the new connections it opens (`visibility` unless a mode change with "
        "`direction: outbound` moved it).",
    )
    outbound_mode_since = serializers.DateTimeField(
        help_text="When the current outbound mode was chosen (the mode change, or the enrolment)."
    )
    latest_version = serializers.CharField(
        allow_null=True, help_text="Version of the latest rendered policy."
    )
    applied_version = serializers.CharField(allow_null=True, help_text="Version the agent last applied.")
    agent_version = serializers.CharField(allow_null=True)
    sync = SyncSerializer()
    health = HealthSerializer()
    enrolled_at = serializers.DateTimeField()


WorkloadPage = inline_serializer(
    "WorkloadPage",
    {"items": WorkloadSerializer(many=True), "next_cursor": serializers.CharField(allow_null=True)},
)
WorkloadCounts = inline_serializer(
    "WorkloadCounts",
    {
        "total": serializers.IntegerField(),
        "sync_state": inline_serializer(
            "SyncStateCounts", {s: serializers.IntegerField() for s in SyncState.values}
        ),
        "removed": serializers.IntegerField(help_text="Owned table absent; these count in no sync state."),
    },
)


class LabelsSerializer(serializers.Serializer):
    labels = serializers.DictField(child=serializers.CharField())
    version = serializers.CharField(read_only=True)


class RenderedPolicySerializer(serializers.Serializer):
    workload_id = serializers.UUIDField()
    mode = serializers.ChoiceField(choices=Mode.values)
    outbound_mode = serializers.ChoiceField(choices=Mode.values)
    version = serializers.CharField(allow_null=True)
    rendered_at = serializers.DateTimeField(allow_null=True)
    document = serializers.CharField(allow_null=True, help_text="The nftables text of `table inet palisade`.")
    rule_index = serializers.DictField(
        child=serializers.DictField(),
        help_text="Rule number in the conntrack mark -> ruleset and rule (`action`: `deny` for a deny rule, "
        "absent for an allow rule).",
    )


ResendSerializer = inline_serializer(
    "ResendSnapshot", {"workload_id": serializers.UUIDField(), "directive": serializers.CharField()}
)

Selection = inline_serializer(
    "Selection",
    {
        "labels": serializers.ListField(child=serializers.CharField(), required=False),
        "workload_ids": serializers.ListField(child=serializers.UUIDField(), required=False),
        "all": serializers.BooleanField(required=False),
    },
)
ModeChangeRequest = inline_serializer(
    "ModeChangeRequest",
    {
        "selection": Selection,
        "mode": serializers.ChoiceField(choices=Mode.values),
        "direction": serializers.ChoiceField(
            choices=Direction.values,
            default=Direction.INBOUND,
            help_text="Which mode of the selected workloads the change moves: `inbound` (the default) or "
            "`outbound` (the one judging the connections they open).",
        ),
        "confirm_within_seconds": serializers.IntegerField(
            required=False,
            allow_null=True,
            min_value=CONFIRM_WITHIN_MIN,
            max_value=CONFIRM_WITHIN_MAX,
            help_text="The change must be confirmed (`POST /mode-changes/{id}/confirm`) within this many "
            "seconds, or the system puts its workloads back into the mode each had before. "
            "Absent or null: nothing to confirm.",
        ),
    },
)


class ModeChangeSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    mode = serializers.ChoiceField(
        choices=Mode.values,
        allow_null=True,
        help_text="The mode the change moves its workloads to. Null only for a revert whose workloads "
        "went back to different modes (each one's is in `workloads` of `GET /mode-changes/{id}`).",
    )
    direction = serializers.ChoiceField(
        choices=Direction.values, help_text="Which mode it moves: the inbound one or the outbound one."
    )
    selection = serializers.DictField(help_text="A revert's is the `workload_ids` of the change it put back.")
    resolved_count = serializers.IntegerField()
    changed_count = serializers.IntegerField()
    actor = serializers.CharField(
        help_text="Who asked: an operator's token or session, a host command, or `system`."
    )
    created_at = serializers.DateTimeField()
    confirm_by = serializers.DateTimeField(
        allow_null=True, help_text="The deadline to confirm the change by; null: nothing to confirm."
    )
    confirmation = serializers.ChoiceField(
        choices=["awaiting", "confirmed", "reverted"],
        allow_null=True,
        help_text="`awaiting` until confirmed or put back (also for the seconds between the deadline and "
        "the revert); null: nothing to confirm.",
    )
    confirmed_at = serializers.DateTimeField(allow_null=True)
    confirmed_by = serializers.CharField(allow_null=True, help_text="The actor that confirmed it.")
    reverted_at = serializers.DateTimeField(allow_null=True)
    reverted_by = serializers.UUIDField(
        allow_null=True, help_text="The system's mode change that put it back."
    )
    reverts = serializers.UUIDField(
        allow_null=True, help_text="For the system's revert: the mode change it put back."
    )
    reason = serializers.CharField(allow_null=True, help_text="Why the system made this mode change.")


class ModeChangeWorkloadSerializer(serializers.Serializer):
    workload_id = serializers.UUIDField()
    mode_before = serializers.ChoiceField(choices=Mode.values)
    mode_after = serializers.ChoiceField(choices=Mode.values)


class LeftAloneSerializer(serializers.Serializer):
    workload_id = serializers.UUIDField()
    mode = serializers.ChoiceField(choices=Mode.values, help_text="Its mode when the revert left it.")
    moved_by = serializers.UUIDField(
        allow_null=True, help_text="The latest mode change that selected it, which holds it now."
    )


class ModeChangeDetailSerializer(ModeChangeSerializer):
    workloads = ModeChangeWorkloadSerializer(
        many=True,
        help_text="A change with a deadline: each workload it moved away from the mode its revert would "
        "put back, with that mode (`mode_before`). A revert: each workload it put back. Empty otherwise.",
    )
    left_alone = LeftAloneSerializer(
        many=True,
        help_text="A revert: the workloads of the change that a later mode change had taken over, left as "
        "they were. Empty otherwise.",
    )


PreviewRequest = inline_serializer("SelectorPreviewRequest", {"selector": serializers.CharField()})
PreviewSerializer = inline_serializer(
    "SelectorPreview",
    {
        "selector": serializers.CharField(),
        "count": serializers.IntegerField(),
        "workloads": serializers.ListField(child=serializers.DictField()),
        "truncated": serializers.BooleanField(),
    },
)
RevokeCredentialRequest = inline_serializer(
    "RevokeCredentialRequest",
    {
        "reason": serializers.CharField(
            required=False,
            allow_blank=True,
            max_length=1000,
            help_text="Why, shown on the workload (one line).",
        )
    },
)

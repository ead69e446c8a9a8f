"""OpenAPI shapes of stored flow evidence (documentation; flows/representations.py builds them)."""

from rest_framework import serializers

from flows.choices import Decision, Direction, GapKind, GapSource
from policy.choices import RuleAction


class FlowGroupSerializer(serializers.Serializer):
    peer = serializers.CharField(
        help_text=(
            "The remote address; `*` for the window's aggregate key of this decision: the connections of "
            "its keys over the bound, summed (their peers, services and rules are not known; the "
            "window's `keys_aggregated` gap says how many keys). Never an address."
        )
    )
    peer_workload_id = serializers.UUIDField(
        allow_null=True, help_text="The workload that has this address, if any."
    )
    protocol = serializers.CharField(
        help_text="tcp, udp, icmp, icmpv6, or a protocol number; `*` for the aggregate key."
    )
    port = serializers.IntegerField(
        help_text="The local (service) port; 0 for protocols without ports and for the aggregate key."
    )
    decision = serializers.ChoiceField(choices=Decision.values)
    rule_number = serializers.IntegerField(
        allow_null=True, help_text="The deciding rule's lifetime number (null for the aggregate key)."
    )
    rule_id = serializers.UUIDField(
        allow_null=True, help_text="The rule holding that number now; null if deleted."
    )
    connection_count = serializers.IntegerField()
    first_seen = serializers.DateTimeField()
    last_seen = serializers.DateTimeField()
    bytes_in = serializers.IntegerField(help_text="0 unless the window's `accounting` is true.")
    bytes_out = serializers.IntegerField()
    direction = serializers.ChoiceField(
        choices=Direction.values,
        required=False,
        help_text=(
            "Read with `direction` outbound or any only: who originated the connection. Outbound: the "
            "peer is the destination and the port the destination's."
        ),
    )
    failsafe = serializers.BooleanField(
        required=False,
        help_text=(
            "Read with `direction` outbound or any only: allowed by the fail-safe list (DNS, NTP) "
            "instead of a rule (`rule_number` null)."
        ),
    )


class FlowWindowSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    workload_id = serializers.UUIDField()
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    policy_version = serializers.CharField(
        allow_null=True, help_text="The policy version in force when it closed."
    )
    accounting = serializers.BooleanField(help_text="Whether bytes were counted (nf_conntrack_acct=1).")
    received_at = serializers.DateTimeField()
    groups = FlowGroupSerializer(many=True)


class EvidenceGapSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    workload_id = serializers.UUIDField()
    kind = serializers.ChoiceField(
        choices=GapKind.values,
        help_text=(
            "The spec's kinds, and `keys_aggregated`: a window held more keys than are kept one by one, "
            "and those over the bound were summed into its aggregate keys (peer `*`)."
        ),
    )
    source = serializers.ChoiceField(choices=GapSource.values, allow_null=True)
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    lost = serializers.DictField(
        child=serializers.IntegerField(),
        help_text=(
            "What was lost, where known. For `keys_aggregated`: `keys` summed (their peers, services and "
            "rules are lost) and the `connections` they counted (all in the aggregate keys)."
        ),
    )


class ServiceKeySerializer(serializers.Serializer):
    protocol = serializers.CharField(help_text="As a group's; `*` with port 0 for the aggregate keys.")
    port = serializers.IntegerField()


class RollupRowSerializer(serializers.Serializer):
    """One group: the keys asked for in `group_by` (only those), and the sums."""

    workload_id = serializers.UUIDField(required=False)
    peer = serializers.CharField(
        required=False, help_text="An address, or `*`: the aggregate keys (keys over the bound, summed)."
    )
    peer_workload_id = serializers.UUIDField(required=False, allow_null=True)
    service = ServiceKeySerializer(required=False)
    decision = serializers.ChoiceField(choices=Decision.values, required=False)
    direction = serializers.ChoiceField(
        choices=Direction.values, required=False, help_text="Grouped by `direction`."
    )
    rule_number = serializers.IntegerField(required=False, allow_null=True)
    rule_id = serializers.UUIDField(required=False, allow_null=True)
    rule_action = serializers.ChoiceField(
        choices=RuleAction.values,
        required=False,
        allow_null=True,
        help_text="Grouped by rule: the action of the rule the number names now (`deny`: its rows are "
        "the connections it refused); null when no rule holds the number.",
    )
    ruleset_id = serializers.UUIDField(required=False, allow_null=True)
    window_start = serializers.DateTimeField(required=False, help_text="Grouped by `window`.")
    connection_count = serializers.IntegerField()
    bytes_in = serializers.IntegerField()
    bytes_out = serializers.IntegerField()
    first_seen = serializers.DateTimeField()
    last_seen = serializers.DateTimeField(help_text="Grouped by rule: the rule's last hit in the range.")


class SilentWorkloadSerializer(serializers.Serializer):
    workload_id = serializers.UUIDField()
    hostname = serializers.CharField()
    since = serializers.DateTimeField(help_text="Its last flow report or heartbeat.")


class CoverageSerializer(serializers.Serializer):
    complete = serializers.BooleanField(
        help_text=(
            "No gap, no workload without reports, no silent workload, none holding evidence not delivered, "
            "a range within the retention: "
            "the totals are the whole truth."
        )
    )
    retained_from = serializers.DateTimeField(
        help_text="Evidence that ended before this is removed (the retention, serve's --flow-retention-days): "
        "a range that begins earlier is not complete."
    )
    begins_before_retention = serializers.BooleanField(
        help_text="The range begins before `retained_from`: its first part has been removed."
    )
    gap_count = serializers.IntegerField()
    gaps = EvidenceGapSerializer(many=True, help_text="The first 100.")
    workloads_without_reports_count = serializers.IntegerField()
    workloads_without_reports = serializers.ListField(
        child=serializers.UUIDField(), help_text="The first 100."
    )
    silent_workloads_count = serializers.IntegerField(
        help_text=(
            "Workloads whose agent went silent before the range's end (or now) and has not reported since: "
            "offline, with no flow report and no heartbeat for more than two of its windows. The agent_silent "
            "gap is recorded only when it reports again; until then the range after `since` has no evidence."
        )
    )
    silent_workloads = SilentWorkloadSerializer(many=True, help_text="The first 100.")
    pending_workloads_count = serializers.IntegerField(
        help_text=(
            "Workloads whose agent, connected, says on its heartbeats that it holds flow windows or gaps "
            "from before the range's end that have not been delivered (its flow reports are held back). "
            "They may yet arrive; until then the totals lack them."
        )
    )
    pending_workloads = SilentWorkloadSerializer(
        many=True, help_text="The first 100; `since`: the start of the oldest evidence it holds."
    )


class UnusedRuleSerializer(serializers.Serializer):
    rule_id = serializers.UUIDField()
    rule_number = serializers.IntegerField()
    ruleset_id = serializers.UUIDField()
    ruleset_name = serializers.CharField()
    action = serializers.ChoiceField(choices=RuleAction.values)


class RollupSerializer(serializers.Serializer):
    items = RollupRowSerializer(many=True)
    next_cursor = serializers.CharField(allow_null=True)
    coverage = CoverageSerializer()
    unused_rules = UnusedRuleSerializer(
        many=True,
        allow_null=True,
        help_text="Grouped by rule alone: the rules with no hit in the range; null unless coverage is complete.",
    )


class WouldBlockSerializer(serializers.Serializer):
    workload_id = serializers.UUIDField()
    peer = serializers.CharField()
    service = ServiceKeySerializer()
    direction = serializers.ChoiceField(
        choices=Direction.values, required=False, help_text="Reviewed with `direction=any` only."
    )
    connection_count = serializers.IntegerField()
    rule_number = serializers.IntegerField(
        allow_null=True, help_text="The deny rule that refused these connections; null: no rule admits them."
    )
    rule_id = serializers.UUIDField(allow_null=True)
    rule_action = serializers.ChoiceField(choices=RuleAction.values, allow_null=True)


class ReviewWorkloadSerializer(serializers.Serializer):
    workload_id = serializers.UUIDField()
    hostname = serializers.CharField()
    last_heard_from = serializers.DateTimeField(required=False, allow_null=True)
    mode = serializers.CharField(required=False)
    mode_since = serializers.DateTimeField(required=False)
    outbound_mode = serializers.CharField(
        required=False, help_text="Reviewed with `direction=outbound` or `any`: the outbound mode."
    )
    outbound_mode_since = serializers.DateTimeField(required=False)


class DecidedOutsideSimulationSerializer(serializers.Serializer):
    workload_id = serializers.UUIDField()
    decision = serializers.CharField(help_text="`observed` or `blocked`.")
    connection_count = serializers.IntegerField()


class ReviewSerializer(serializers.Serializer):
    verdict = serializers.ChoiceField(choices=["pass", "fail"])
    reasons = serializers.ListField(child=serializers.CharField())
    workload_count = serializers.IntegerField(help_text="Workloads selected; none fails the review.")
    would_block_count = serializers.IntegerField(
        help_text="Would-block groups; the list shows the first 1,000."
    )
    would_block = WouldBlockSerializer(many=True)
    coverage = CoverageSerializer()
    offline_count = serializers.IntegerField(help_text="Offline workloads; the list shows the first 100.")
    offline = ReviewWorkloadSerializer(many=True)
    not_in_simulation_count = serializers.IntegerField(
        help_text="Workloads not in simulation for the whole range; the list shows the first 100."
    )
    not_in_simulation = ReviewWorkloadSerializer(many=True)
    decided_outside_simulation = DecidedOutsideSimulationSerializer(
        many=True,
        help_text=(
            "Connections in the range that the table of a workload in simulation for the whole range decided "
            "as another mode's does (`observed`: visibility, `blocked`: enforced), per workload and decision: "
            "its agent had not applied the mode "
            "change yet, or could not. What enforcing would do to them is unknown; any fails the review. "
            "The first 100."
        ),
    )

"""OpenAPI shapes of draft policy: the render dry-run, the impact over past traffic and the suggested
rules (documentation; the domain functions build the answers)."""

from drf_spectacular.utils import inline_serializer
from rest_framework import serializers

from fleet.choices import Mode
from flows.api.schemas import CoverageSerializer, ReviewSerializer, ServiceKeySerializer
from flows.choices import READ_DIRECTIONS, Direction
from policy.choices import RuleAction

DryrunRequest = inline_serializer(
    "RenderDryrunRequest",
    {
        "rulesets": serializers.ListField(child=serializers.DictField()),
        "services": serializers.ListField(child=serializers.DictField(), required=False),
        "address_groups": serializers.ListField(child=serializers.DictField(), required=False),
    },
)
DryrunSerializer = inline_serializer(
    "RenderDryrun",
    {
        "changed_count": serializers.IntegerField(),
        "unchanged_count": serializers.IntegerField(),
        "changed": serializers.ListField(child=serializers.DictField()),
        "truncated": serializers.BooleanField(),
        "warnings": serializers.ListField(child=serializers.DictField()),
    },
)
ImpactRequest = inline_serializer(
    "PolicyImpactRequest",
    {
        "rulesets": serializers.ListField(
            child=serializers.DictField(), help_text="The draft: as `POST /policies/render-dryrun`."
        ),
        "services": serializers.ListField(child=serializers.DictField(), required=False),
        "address_groups": serializers.ListField(child=serializers.DictField(), required=False),
        "from": serializers.DateTimeField(help_text="The range's start (RFC 3339), as the rollup's `from`."),
        "to": serializers.DateTimeField(help_text="The range's end, at most 31 days after `from`."),
        "label": serializers.ListField(
            child=serializers.CharField(), required=False, help_text="Workload selection: selectors, ANDed."
        ),
        "workload": serializers.ListField(
            child=serializers.UUIDField(), required=False, help_text="Workload selection: ids, ANDed."
        ),
        "direction": serializers.ChoiceField(
            choices=READ_DIRECTIONS,
            required=False,
            help_text="The evidence the draft is judged against: the connections the selected workloads "
            "received (inbound), opened (outbound, judged by the output chain: their outbound rules, their "
            "destinations' inbound rules, the fail-safe list) or both. Default: `outbound` when every ruleset "
            "of the draft is outbound, else `inbound`.",
        ),
    },
)


class PolicyImpactRuleSerializer(serializers.Serializer):
    number = serializers.IntegerField(help_text="The lifetime number, as the ct mark carries it.")
    ruleset_id = serializers.CharField()
    ruleset_name = serializers.CharField()
    rule_id = serializers.CharField(help_text="A draft's new rule: `new:<ruleset name>:<position>`.")
    position = serializers.IntegerField()
    action = serializers.ChoiceField(choices=RuleAction.values, help_text="`deny`: the rule refuses the key.")


class PolicyImpactKeySerializer(serializers.Serializer):
    workload_id = serializers.UUIDField()
    direction = serializers.ChoiceField(
        choices=Direction.values,
        help_text="Who opened the connection: the peer (inbound) or the workload (outbound; the peer is the "
        "destination, the port the destination's).",
    )
    mode = serializers.ChoiceField(
        choices=Mode.values,
        help_text="Now, of the key's direction (the outbound mode for outbound); keys are judged as rules "
        "judge them.",
    )
    peer = serializers.CharField()
    peer_workload_id = serializers.UUIDField(allow_null=True)
    protocol = serializers.CharField()
    port = serializers.IntegerField()
    connection_count = serializers.IntegerField()
    first_seen = serializers.DateTimeField()
    last_seen = serializers.DateTimeField()
    rule_now = PolicyImpactRuleSerializer(
        allow_null=True,
        help_text="The rule in force now that admits it, or the deny rule that refuses it (null: no rule admits it).",
    )
    rule_draft = PolicyImpactRuleSerializer(
        allow_null=True,
        help_text="The draft's rule that admits it, or the deny rule that refuses it (null: no rule admits it).",
    )


class PolicyImpactSummarySerializer(serializers.Serializer):
    count = serializers.IntegerField(help_text="Keys (workload, peer, service).")
    connection_count = serializers.IntegerField()
    peer_count = serializers.IntegerField()
    service_count = serializers.IntegerField()
    workload_count = serializers.IntegerField()


class PolicyImpactSerializer(serializers.Serializer):
    # "from" is a keyword: declared below.
    to = serializers.DateTimeField()
    direction = serializers.ChoiceField(
        choices=READ_DIRECTIONS, help_text="The evidence judged: as asked, or the draft's."
    )
    keys_classified = serializers.IntegerField(help_text="Flow keys (workload, peer, service) of the range.")
    newly_refused_summary = PolicyImpactSummarySerializer()
    newly_refused = PolicyImpactKeySerializer(
        many=True,
        help_text="Admitted by a rule now, by none in the draft (enforced would block them); most connections "
        "first, the first 1,000.",
    )
    newly_admitted_summary = PolicyImpactSummarySerializer()
    newly_admitted = PolicyImpactKeySerializer(
        many=True, help_text="Admitted by no rule now, by one in the draft; the first 1,000."
    )
    truncated = serializers.BooleanField(
        help_text="A list stopped at 1,000 entries, or the keys read at their bound (keys_left_out)."
    )
    keys_total = serializers.IntegerField(
        help_text="Flow keys of the range (the windows' aggregate keys aside), every one counted."
    )
    keys_left_out = serializers.IntegerField(
        help_text="Keys not read: past the bound of 20,000 keys read, those of fewest connections."
    )
    connections_left_out = serializers.IntegerField(help_text="The connections of the keys left out.")
    coverage = CoverageSerializer()
    warnings = serializers.ListField(child=serializers.DictField())


PolicyImpactSerializer._declared_fields["from"] = serializers.DateTimeField()
ImpactSerializer = PolicyImpactSerializer


class SuggestionRequestSerializer(serializers.Serializer):
    label = serializers.ListField(
        child=serializers.CharField(),
        required=False,
        max_length=64,
        help_text="Label selectors, ANDed (at most 64): the workloads to protect.",
    )
    workload = serializers.ListField(
        child=serializers.UUIDField(),
        required=False,
        help_text="Workload ids: repeats count once, at most 1,000 distinct.",
    )
    # `from` is a keyword: declared below.
    to = serializers.DateTimeField(help_text="RFC 3339; at most 31 days after `from`.")
    label_keys = serializers.ListField(
        child=serializers.CharField(),
        required=False,
        max_length=16,
        help_text='The label keys that name a group of workloads (at most 16); default ["app"].',
    )
    aggregate_prefix = serializers.IntegerField(
        required=False,
        min_value=0,
        max_value=32,
        help_text="Aggregate outside IPv4 peers into CIDRs of this length.",
    )
    aggregate_prefix_v6 = serializers.IntegerField(required=False, min_value=0, max_value=128)
    include_noise = serializers.ListField(
        child=serializers.ChoiceField(choices=["scanner", "ephemeral-port", "lookalike-label"]),
        required=False,
        help_text="Kinds of noise to propose rules for anyway (set apart by default).",
    )
    exclude_peers = serializers.ListField(
        child=serializers.CharField(),
        required=False,
        max_length=1000,
        help_text="Addresses or CIDRs never learnt from: their keys are set apart (`excluded-peer`).",
    )
    direction = serializers.ChoiceField(
        choices=Direction.values,
        required=False,
        help_text="inbound (the default): rules for the connections the selected workloads receive. outbound: "
        "outbound rulesets (`direction: outbound`, rules with `destinations`) for the connections they open, "
        "never proposing what the destination's inbound policy, their own outbound rules or the fail-safe "
        "list admit now.",
    )


SuggestionRequestSerializer._declared_fields["from"] = serializers.DateTimeField(help_text="RFC 3339.")


class SuggestedSpanSerializer(serializers.Serializer):
    connection_count = serializers.IntegerField()
    first_seen = serializers.DateTimeField()
    last_seen = serializers.DateTimeField()


class SuggestedPeerSerializer(SuggestedSpanSerializer):
    peer = serializers.CharField()
    peer_workload_id = serializers.UUIDField(allow_null=True)


class SuggestedServiceSerializer(SuggestedSpanSerializer):
    protocol = serializers.CharField()
    port = serializers.IntegerField()


class PortRangeEvidenceSerializer(serializers.Serializer):
    protocol = serializers.CharField()
    port = serializers.IntegerField()
    port_to = serializers.IntegerField()
    ports_seen = serializers.IntegerField()
    ports_unseen = serializers.IntegerField(help_text="Ports of the range admitted though never seen.")


class BreadthSerializer(serializers.Serializer):
    admitted = serializers.IntegerField(
        help_text="(workload, peer, service) combinations the rule admits: workloads its scope matches "
        "now x peers its sources admit x ports of its services."
    )
    seen = serializers.IntegerField(help_text="Distinct combinations of the rule's evidence.")
    ratio = serializers.FloatField(allow_null=True)
    wider_than_seen = serializers.BooleanField(help_text="Admits more than twice what was seen.")


class RuleGroupEvidenceSerializer(serializers.Serializer):
    name = serializers.CharField()
    addresses_seen = serializers.IntegerField()
    unseen_addresses_admitted = serializers.IntegerField()


class SuggestedRuleEvidenceSerializer(SuggestedSpanSerializer):
    peers = SuggestedPeerSerializer(many=True)
    services = SuggestedServiceSerializer(many=True)
    port_ranges = PortRangeEvidenceSerializer(
        many=True, help_text="Runs of ports proposed as one range, with the ports they admit unseen."
    )
    workload_ids = serializers.ListField(child=serializers.UUIDField())
    breadth = BreadthSerializer()
    address_groups = RuleGroupEvidenceSerializer(
        many=True, help_text="The address groups of the rule's sources, with the addresses they admit unseen."
    )


class SuggestedRulesetEvidenceSerializer(serializers.Serializer):
    ruleset = serializers.CharField(help_text="The proposed ruleset's name.")
    workloads = serializers.ListField(child=serializers.UUIDField())
    rules = SuggestedRuleEvidenceSerializer(many=True, help_text="In the order of the ruleset's rules.")


class AddressGroupEvidenceSerializer(serializers.Serializer):
    name = serializers.CharField()
    addresses_seen = serializers.IntegerField()
    unseen_addresses_admitted = serializers.IntegerField(
        help_text="Addresses the members admit beyond those seen: 0 unless aggregation was asked for."
    )


class SuggestionKeySerializer(SuggestedSpanSerializer):
    workload_id = serializers.UUIDField()
    peer = serializers.CharField()
    peer_workload_id = serializers.UUIDField(allow_null=True)
    service = ServiceKeySerializer()


class NotGeneralisedSerializer(SuggestionKeySerializer):
    reason = serializers.CharField()
    rule_number = serializers.IntegerField(
        required=False, help_text="A key a deny rule in force refuses: that rule's number (never learnt)."
    )


class SetApartSerializer(SuggestionKeySerializer):
    kind = serializers.ChoiceField(choices=["scanner", "ephemeral-port", "lookalike-label", "excluded-peer"])
    reason = serializers.CharField()


class SetApartSummarySerializer(serializers.Serializer):
    kind = serializers.CharField()
    count = serializers.IntegerField()
    connection_count = serializers.IntegerField()
    peer_count = serializers.IntegerField()
    reasons = serializers.ListField(child=serializers.CharField(), help_text="The first 20, sorted.")


class ScopeNoteSerializer(serializers.Serializer):
    scope = serializers.CharField(help_text="The scope of the label keys' values alone.")
    narrowed_to = serializers.CharField(
        allow_null=True, help_text="The scope proposed instead; null: refused (its keys not generalised)."
    )
    reason = serializers.CharField()


class IncompleteIntervalSerializer(serializers.Serializer):
    workload_id = serializers.UUIDField(allow_null=True)
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    reason = serializers.CharField()


class SuggestionSerializer(serializers.Serializer):
    to = serializers.DateTimeField()
    direction = serializers.ChoiceField(
        choices=Direction.values, help_text="Whose connections were learnt from, as asked."
    )
    label_keys = serializers.ListField(child=serializers.CharField())
    complete = serializers.BooleanField(help_text="The range's coverage is complete.")
    warning = serializers.CharField(allow_null=True, help_text="Set when the range is incomplete.")
    draft = serializers.DictField(
        allow_null=True,
        help_text="The one ruleset body, as POST /rulesets takes it, when the evidence has one scope.",
    )
    rulesets = serializers.ListField(child=serializers.DictField(), help_text="A ruleset body per scope.")
    address_groups = serializers.ListField(
        child=serializers.DictField(),
        help_text="Address group bodies to create first (POST /address-groups).",
    )
    services = serializers.ListField(child=serializers.DictField(), help_text="Services to create first.")
    address_group_evidence = AddressGroupEvidenceSerializer(many=True)
    evidence = SuggestedRulesetEvidenceSerializer(many=True)
    not_generalised_count = serializers.IntegerField()
    not_generalised = NotGeneralisedSerializer(
        many=True, help_text="The first 1,000, most connections first."
    )
    breadth_warnings = serializers.ListField(
        child=serializers.CharField(), help_text="Rules that admit more than twice the combinations seen."
    )
    scope_notes = ScopeNoteSerializer(
        many=True, help_text="Scopes narrowed (or refused) to stay inside the selection."
    )
    set_apart_count = serializers.IntegerField()
    set_apart_summary = SetApartSummarySerializer(many=True)
    set_apart = SetApartSerializer(
        many=True,
        help_text="Keys that look like noise, not proposed (see include_noise): the first 1,000, most "
        "connections first.",
    )
    hostnames = serializers.DictField(
        child=serializers.CharField(), help_text="The host name of each workload the answer names, by id."
    )
    admitted_now_count = serializers.IntegerField()
    admitted_now = SuggestionKeySerializer(
        many=True,
        help_text="Keys decided unadmitted in the range that a rule in force now admits, not proposed: "
        "the first 1,000, most connections first.",
    )
    coverage = CoverageSerializer()
    incomplete_intervals = IncompleteIntervalSerializer(many=True)
    truncated = serializers.BooleanField(
        help_text="The keys read stopped at their bound: the proposal lacks the keys left out."
    )
    keys_total = serializers.IntegerField(
        help_text="Flow keys of the range (the windows' aggregate keys aside), every one counted."
    )
    keys_left_out = serializers.IntegerField(
        help_text="Keys not read: past the bound of 20,000 keys read, those of fewest connections."
    )
    connections_left_out = serializers.IntegerField(help_text="The connections of the keys left out.")


SuggestionSerializer._declared_fields["from"] = serializers.DateTimeField()


class DraftSaveRequest(serializers.Serializer):
    services = serializers.ListField(
        child=serializers.DictField(), required=False, help_text="Service bodies."
    )
    address_groups = serializers.ListField(
        child=serializers.DictField(), required=False, help_text="Address group bodies."
    )
    rulesets = serializers.ListField(
        child=serializers.DictField(),
        help_text="Ruleset bodies; they may name the draft's groups and services.",
    )


class SavedObjectSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()


class DraftSavedSerializer(serializers.Serializer):
    services = SavedObjectSerializer(many=True)
    address_groups = SavedObjectSerializer(many=True)
    rulesets = SavedObjectSerializer(many=True)


class ReviewNowVerdictSerializer(serializers.Serializer):
    judged_against = serializers.CharField(help_text="`the policy in force now`.")
    verdict = serializers.ChoiceField(choices=["pass", "fail"])
    reasons = serializers.ListField(child=serializers.CharField())
    would_block_count = serializers.IntegerField(
        help_text="Recorded would-block groups that the policy in force now would still refuse."
    )
    admitted_since_count = serializers.IntegerField(
        help_text="Recorded would-block groups that a rule in force now admits (saved since)."
    )


class ReviewNowSerializer(ReviewSerializer):
    judged_against = serializers.CharField(help_text="`the decisions recorded in the range`.")
    now = ReviewNowVerdictSerializer(
        help_text="The same review with the recorded would-block groups judged against the policy in "
        "force now, as the console's enforce panel judges them."
    )

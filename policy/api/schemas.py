"""OpenAPI shapes of policy objects (documentation only: validation lives in policy/validation.py)."""

from drf_spectacular.utils import PolymorphicProxySerializer
from rest_framework import serializers

from policy.choices import Direction, RuleAction
from policy.validation import (
    MAX_DESCRIPTION,
    MAX_GROUP_MEMBERS,
    MAX_NAME,
    MAX_RULES_PER_RULESET,
    MAX_SERVICE_ENTRIES,
    MAX_SERVICES_PER_RULE,
    MAX_SOURCES_PER_RULE,
    PROTOCOLS,
)


class PortEntrySerializer(serializers.Serializer):
    protocol = serializers.ChoiceField(choices=PROTOCOLS)
    port = serializers.IntegerField(
        min_value=1, max_value=65535, required=False, help_text="tcp/udp only; required for them."
    )
    port_to = serializers.IntegerField(
        min_value=1, max_value=65535, required=False, help_text="Inclusive end of a port range; tcp/udp only."
    )


class _Stamped(serializers.Serializer):
    id = serializers.UUIDField(read_only=True)
    version = serializers.CharField(
        read_only=True, help_text="Opaque; also the ETag. Send it back in If-Match."
    )
    created_at = serializers.DateTimeField(read_only=True)
    updated_at = serializers.DateTimeField(read_only=True)


class ServiceSerializer(_Stamped):
    name = serializers.CharField(max_length=MAX_NAME)
    description = serializers.CharField(max_length=MAX_DESCRIPTION, required=False, allow_blank=True)
    entries = serializers.ListField(child=PortEntrySerializer(), min_length=1, max_length=MAX_SERVICE_ENTRIES)


class AddressGroupSerializer(_Stamped):
    name = serializers.CharField(max_length=MAX_NAME)
    description = serializers.CharField(max_length=MAX_DESCRIPTION, required=False, allow_blank=True)
    members = serializers.ListField(
        child=serializers.CharField(),
        max_length=MAX_GROUP_MEMBERS,
        help_text="IPv4/IPv6 addresses or CIDRs; stored normalised and sorted.",
    )


class SelectorSource(serializers.Serializer):
    selector = serializers.CharField(
        allow_blank=True,
        help_text="A label selector over workloads, e.g. `role=client,env in (prod)`; empty: every workload.",
    )


class AddressGroupSource(serializers.Serializer):
    address_group = serializers.CharField(help_text="Address group id (a name is accepted on input).")


class AnySource(serializers.Serializer):
    any = serializers.BooleanField(help_text="Always true: any source address.")


class ServiceReference(serializers.Serializer):
    service = serializers.CharField(help_text="Service id (a name is accepted on input).")


def _peer_item() -> PolymorphicProxySerializer:
    # One instance per field: a serializer is bound to the field it is the child of.
    return PolymorphicProxySerializer(
        component_name="RuleSourceItem",
        serializers=[SelectorSource, AddressGroupSource, AnySource],
        resource_type_field_name=None,
    )


SOURCE = _peer_item()
SERVICE_ITEM = PolymorphicProxySerializer(
    component_name="RuleServiceItem",
    serializers=[ServiceReference, PortEntrySerializer],
    resource_type_field_name=None,
)


class RuleSerializer(_Stamped):
    id = serializers.UUIDField(
        required=False, help_text="In a ruleset PUT: keep this rule (omit to add a new one)."
    )
    number = serializers.IntegerField(
        read_only=True,
        help_text="The rule's lifetime number, given once and never reused: the rule bits of the ct mark "
        "of connections it admitted, and the key of `rule_index` in rendered policies.",
    )
    description = serializers.CharField(max_length=MAX_DESCRIPTION, required=False, allow_blank=True)
    action = serializers.ChoiceField(
        choices=RuleAction.values,
        default=RuleAction.ALLOW,
        help_text="`allow` (the default) admits what the rule matches; `deny` refuses it, above every allow "
        "rule of every ruleset that applies: dropped in `enforced`, recorded `would_block` in `simulation`, "
        "with this rule's number either way.",
    )
    sources = serializers.ListField(
        child=SOURCE,
        min_length=1,
        max_length=MAX_SOURCES_PER_RULE,
        required=False,
        help_text="A rule of an inbound ruleset: admit (or, for a deny rule, refuse) new inbound connections "
        "from any of these.",
    )
    destinations = serializers.ListField(
        child=_peer_item(),
        min_length=1,
        max_length=MAX_SOURCES_PER_RULE,
        required=False,
        help_text="A rule of an outbound ruleset (instead of `sources`): admit (or refuse) new connections "
        "the scope's workloads open to any of these (the same item kinds as `sources`).",
    )
    services = serializers.ListField(
        child=SERVICE_ITEM,
        min_length=1,
        max_length=MAX_SERVICES_PER_RULE,
        help_text="to any of these protocols and ports.",
    )


class RulesetSerializer(_Stamped):
    name = serializers.CharField(max_length=MAX_NAME)
    description = serializers.CharField(max_length=MAX_DESCRIPTION, required=False, allow_blank=True)
    enabled = serializers.BooleanField(default=True)
    scope = serializers.CharField(
        allow_blank=True,
        help_text="Selector of the workloads whose inbound traffic the rules admit, or, in an outbound "
        "ruleset, whose outgoing connections they admit (empty: every workload).",
    )
    direction = serializers.ChoiceField(
        choices=Direction.values,
        default=Direction.INBOUND,
        help_text="`inbound` (the default): the rules judge connections the scope's workloads receive, "
        "from their `sources`; `outbound`: connections they open, to their `destinations`.",
    )
    rules = serializers.ListField(child=RuleSerializer(), required=False, max_length=MAX_RULES_PER_RULESET)


class RulesetListSerializer(serializers.Serializer):
    rulesets = RulesetSerializer(many=True)
    policy_version = serializers.CharField(
        help_text="Moves with any ruleset, rule, service or address group change."
    )


class ServiceListSerializer(serializers.Serializer):
    services = ServiceSerializer(many=True)
    policy_version = serializers.CharField()


class AddressGroupListSerializer(serializers.Serializer):
    address_groups = AddressGroupSerializer(many=True)
    policy_version = serializers.CharField()

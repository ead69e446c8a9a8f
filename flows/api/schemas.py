"""OpenAPI shapes of stored flow evidence (documentation; flows/representations.py builds them)."""

from rest_framework import serializers

from flows.choices import Decision, GapKind, GapSource


class FlowGroupSerializer(serializers.Serializer):
    peer = serializers.CharField(help_text="The remote address.")
    peer_workload_id = serializers.UUIDField(
        allow_null=True, help_text="The workload that has this address, if any."
    )
    protocol = serializers.CharField(help_text="tcp, udp, icmp, icmpv6, or a protocol number.")
    port = serializers.IntegerField(help_text="The local (service) port; 0 for protocols without ports.")
    decision = serializers.ChoiceField(choices=Decision.values)
    rule_number = serializers.IntegerField(allow_null=True, help_text="The deciding rule's lifetime number.")
    rule_id = serializers.UUIDField(
        allow_null=True, help_text="The rule holding that number now; null if deleted."
    )
    connection_count = serializers.IntegerField()
    first_seen = serializers.DateTimeField()
    last_seen = serializers.DateTimeField()
    bytes_in = serializers.IntegerField(help_text="0 unless the window's `accounting` is true.")
    bytes_out = serializers.IntegerField()


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
    kind = serializers.ChoiceField(choices=GapKind.values)
    source = serializers.ChoiceField(choices=GapSource.values, allow_null=True)
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    lost = serializers.DictField(child=serializers.IntegerField(), help_text="What was lost, where known.")

"""Authored policy: named services, address groups, rulesets and their rules.

References from rules to services and address groups are rows with PROTECT foreign keys, so the
database itself refuses a dangling reference, whatever the interleaving of concurrent requests.
"""

import uuid

from django.db import models

from policy.choices import Direction, RuleAction, SourceKind


class PolicyState(models.Model):
    """One row: the version of the whole authored policy. Every policy write locks it first, which
    serialises policy writes and lets an editor detect any concurrent change."""

    version = models.PositiveBigIntegerField(default=1)
    # The next rule's lifetime number (Rule.number): only ever increases, so a number is never reused.
    next_rule_number = models.PositiveIntegerField(default=1)
    # Set by a migration whose release renders documents differently from stored ones (an upgrade);
    # serve re-renders every workload before it listens and clears it (fleet.rendering).
    documents_stale = models.BooleanField(default=False)


class Service(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, unique=True)
    description = models.CharField(max_length=1000, blank=True)
    version = models.PositiveBigIntegerField(default=1)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()


class ServiceEntry(models.Model):
    service = models.ForeignKey(Service, on_delete=models.CASCADE, related_name="entries")
    position = models.PositiveIntegerField()
    protocol = models.CharField(max_length=8)
    port = models.PositiveIntegerField(null=True)
    port_to = models.PositiveIntegerField(null=True)

    class Meta:
        ordering = ["position"]
        constraints = [models.UniqueConstraint(fields=["service", "position"], name="service_entry_position")]


class AddressGroup(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, unique=True)
    description = models.CharField(max_length=1000, blank=True)
    members = models.JSONField(default=list)  # normalised address / CIDR strings, sorted
    version = models.PositiveBigIntegerField(default=1)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()


class Ruleset(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, unique=True)
    description = models.CharField(max_length=1000, blank=True)
    enabled = models.BooleanField(default=True)
    scope = models.CharField(max_length=4096, blank=True)  # canonical selector text
    # outbound: the scope's workloads are the ones opening the connections, and the rules' peers
    # (RuleSource rows) are their destinations.
    direction = models.CharField(max_length=8, choices=Direction.choices, default=Direction.INBOUND)
    version = models.PositiveBigIntegerField(default=1)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()


class Rule(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    ruleset = models.ForeignKey(Ruleset, on_delete=models.CASCADE, related_name="rules")
    # Given once, from PolicyState.next_rule_number, and never reused: the low 24 bits of the ct mark
    # that admitted a connection name this rule in every policy version, before and after edits.
    number = models.PositiveIntegerField(unique=True)
    position = models.PositiveIntegerField()
    description = models.CharField(max_length=1000, blank=True)
    # deny: refuses what it matches, above every allow rule of every ruleset (docs/policy.md).
    action = models.CharField(max_length=8, choices=RuleAction.choices, default=RuleAction.ALLOW)
    version = models.PositiveBigIntegerField(default=1)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        ordering = ["position"]
        indexes = [models.Index(fields=["ruleset", "position"], name="rule_order")]


class RuleSource(models.Model):
    """One source of a rule (its destination, in an outbound ruleset): a workload selector, an
    address group, or any address."""

    rule = models.ForeignKey(Rule, on_delete=models.CASCADE, related_name="sources")
    position = models.PositiveIntegerField()
    kind = models.CharField(max_length=16, choices=SourceKind.choices)
    selector = models.CharField(max_length=4096, blank=True)
    address_group = models.ForeignKey(AddressGroup, on_delete=models.PROTECT, null=True, related_name="uses")

    class Meta:
        ordering = ["position"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(kind=SourceKind.ADDRESS_GROUP, address_group__isnull=False)
                | models.Q(kind__in=[SourceKind.SELECTOR, SourceKind.ANY], address_group__isnull=True),
                name="rule_source_kind_matches_reference",
            )
        ]


class RuleService(models.Model):
    """One service of a rule: a reference to a named service, or an inline port entry."""

    rule = models.ForeignKey(Rule, on_delete=models.CASCADE, related_name="services")
    position = models.PositiveIntegerField()
    service = models.ForeignKey(Service, on_delete=models.PROTECT, null=True, related_name="uses")
    protocol = models.CharField(max_length=8, blank=True)
    port = models.PositiveIntegerField(null=True)
    port_to = models.PositiveIntegerField(null=True)

    class Meta:
        ordering = ["position"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(service__isnull=False, protocol="")
                | models.Q(service__isnull=True) & ~models.Q(protocol=""),
                name="rule_service_reference_or_inline",
            )
        ]

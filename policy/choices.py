"""Policy's vocabulary (see fleet/choices.py)."""

from django.db import models


class SourceKind(models.TextChoices):
    """What a rule's source names: workloads by selector, an address group, or any address."""

    SELECTOR = "selector"
    ADDRESS_GROUP = "address_group"
    ANY = "any"


class RuleAction(models.TextChoices):
    """What a rule does to the connections it matches: admit them, or refuse them above every allow."""

    ALLOW = "allow"
    DENY = "deny"


class Direction(models.TextChoices):
    """Which connections a ruleset governs: those its workloads receive, or those they open."""

    INBOUND = "inbound"
    OUTBOUND = "outbound"

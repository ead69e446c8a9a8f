"""Policy's vocabulary (see fleet/choices.py)."""

from django.db import models


class SourceKind(models.TextChoices):
    """What a rule's source names: workloads by selector, an address group, or any address."""

    SELECTOR = "selector"
    ADDRESS_GROUP = "address_group"
    ANY = "any"

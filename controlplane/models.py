"""What the running service says about itself, for commands run outside `serve` (e.g. minting a
provisioning token needs the gateway address and certificate fingerprint that `serve` uses)."""

from django.db import models


class GatewayIdentity(models.Model):
    """One row, written by `serve` at every start."""

    address = models.CharField(max_length=300)
    fingerprint = models.CharField(max_length=200)
    updated_at = models.DateTimeField()

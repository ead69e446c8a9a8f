"""Removing rendered documents nobody needs any more.

Every change that alters documents stores the new ones (a fleet-wide edit at 10,000 workloads stores
about 150 MB), and a document is kept only while a workload names it: as its latest version, or as
the version its agent last applied (the table that is in the kernel now). Others go once they are
older than the grace, which leaves room for readers that looked a version up a moment ago.

Concurrency on PostgreSQL: a writer that reuses an existing document locks its row (FOR KEY SHARE in
`fleet.rendering._store_documents`) and the prune skips locked rows; if a reference still slips in
between, the foreign key from `latest_policy` fails the prune's transaction, not the writer's.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import connection, transaction

from controlplane import clock
from fleet.models import RenderedPolicy, Workload

BATCH = 500


def rendered_policies_prune(*, older_than: timedelta) -> int:
    """Delete unreferenced documents stored before `older_than` ago; returns how many went."""
    cutoff = clock.now() - older_than
    # The referenced versions are a few thousand at most (shared documents); taking them whole is
    # cheaper than an anti-join per document against a 100,000-row fleet.
    named = set(
        Workload.objects.exclude(latest_policy=None).values_list("latest_policy_id", flat=True).distinct()
    )
    named |= set(Workload.objects.values_list("applied_version", flat=True).distinct())
    candidates = [
        version
        for version in RenderedPolicy.objects.filter(created_at__lt=cutoff).values_list("version", flat=True)
        if version not in named
    ]
    removed = 0
    for start in range(0, len(candidates), BATCH):
        removed += _delete_unless_named(candidates[start : start + BATCH])
    return removed


def _delete_unless_named(versions: list[str]) -> int:
    # Checked again under lock: a change may have named one of them since the candidates were read.
    with transaction.atomic():
        unnamed = RenderedPolicy.objects.filter(version__in=versions).exclude(
            version__in=Workload.objects.filter(latest_policy_id__in=versions).values("latest_policy_id")
        )
        if connection.vendor == "postgresql":
            unnamed = unnamed.select_for_update(skip_locked=True)
        doomed = list(unnamed.values_list("version", flat=True))
        RenderedPolicy.objects.filter(version__in=doomed).delete()
    return len(doomed)

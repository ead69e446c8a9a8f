"""Rendered documents are kept while a workload names them (latest or applied), pruned after."""

from datetime import timedelta

from controlplane.auth.actor import CLI_ACTOR
from controlplane.housekeeping import documents_prune_step
from fleet.models import RenderedPolicy
from fleet.retention import rendered_policies_prune
from fleet.services import mode_change_create
from tests.support.workloads import make_workload

HOUR = timedelta(hours=1)


def stored() -> set[str]:
    return set(RenderedPolicy.objects.values_list("version", flat=True))


def move_to(workload, mode: str) -> str:
    mode_change_create(
        actor=CLI_ACTOR, data={"selection": {"workload_ids": [str(workload.id)]}, "mode": mode}
    )
    workload.refresh_from_db()
    return workload.latest_policy_id


def test_only_documents_no_workload_names_are_pruned_once_past_the_grace(db, clock_at):
    web = make_workload(hostname="web", labels={"app": "web"})
    visibility = web.latest_policy_id
    web.applied_version = visibility  # the agent applied it: its table is in the kernel now
    web.save(update_fields=["applied_version"])
    simulation = move_to(web, "simulation")
    enforced = move_to(web, "enforced")
    assert {visibility, simulation, enforced} <= stored()

    assert documents_prune_step() == 0  # all young (housekeeping.UNREFERENCED_DOCUMENT_GRACE: an hour)
    clock_at(2 * HOUR)
    assert documents_prune_step() == 1
    assert simulation not in stored()  # neither latest nor applied
    assert {visibility, enforced} <= stored()


def test_a_document_named_again_is_kept(db, clock_at):
    web = make_workload(hostname="web")
    first = web.latest_policy_id
    move_to(web, "simulation")
    assert move_to(web, "visibility") == first  # back to the very same document
    clock_at(2 * HOUR)
    rendered_policies_prune(older_than=HOUR)
    web.refresh_from_db()
    assert web.latest_policy_id in stored()
    assert len(stored()) == 1


def test_pruning_goes_in_batches(db, clock_at, monkeypatch):
    import fleet.retention

    monkeypatch.setattr(fleet.retention, "BATCH", 1)
    web = make_workload(hostname="web")
    for mode in ("simulation", "enforced", "simulation", "visibility", "enforced"):
        move_to(web, mode)
    clock_at(2 * HOUR)
    assert rendered_policies_prune(older_than=HOUR) == 2  # visibility and simulation
    assert stored() == {web.latest_policy_id}

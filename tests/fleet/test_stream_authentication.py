"""A stream's authentication reads its workload's row in SQL (fleet/streams.py `_credential_holder`):
the instance it makes must be the ORM's, field for field, on either database."""

from datetime import timedelta

from controlplane import clock
from fleet.credentials import credential_issue
from fleet.models import Workload
from fleet.streams import _credential_holder
from tests.support.workloads import connect, make_workload


def test_the_credential_holder_read_in_sql_is_the_orms_instance(db):
    workload = connect(make_workload(hostname="db-1", labels={"app": "db", "env": "prod"}, mode="enforced"))
    # Fields of each kind a workload has set: UUIDs, instants, JSON, choices, a null and a non-null time.
    Workload.objects.filter(id=workload.id).update(
        credential_revoked_at=None, flow_process_alive_at=clock.now() - timedelta(seconds=5)
    )
    stored = Workload.objects.get(id=workload.id)
    credential = credential_issue(workload=stored).text

    read = _credential_holder(str(workload.id).upper(), credential)

    assert read is not None and type(read) is Workload and not read.get_deferred_fields()
    for field in Workload._meta.concrete_fields:
        assert getattr(read, field.attname) == getattr(stored, field.attname), field.name
        assert type(getattr(read, field.attname)) is type(getattr(stored, field.attname)), field.name


def test_a_credential_of_another_workload_or_none_at_all_finds_no_holder(db):
    one, other = make_workload(render=False), make_workload(render=False)
    credential = credential_issue(workload=one).text
    assert _credential_holder(str(other.id), credential) is None
    assert _credential_holder("not-a-uuid", credential) is None
    Workload.objects.filter(id=one.id).delete()
    assert _credential_holder(str(one.id), credential) is None

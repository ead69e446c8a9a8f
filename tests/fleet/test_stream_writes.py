"""The streams' gathered writes (fleet/stream_writes.py) and the acknowledgements' one statement."""

import asyncio
import json

import pytest
from asgiref.sync import async_to_sync
from django.db import connection

from fleet import stream_writes, sync
from fleet.models import Workload
from tests.support.workloads import connect, make_workload


@pytest.mark.django_db(transaction=True)
def test_what_arrives_while_a_round_is_written_goes_in_the_next_one_statement():
    rounds = []

    def write(*, items):
        rounds.append(list(items))

    gathered = stream_writes.Gathered(write, "items")

    async def scenario():
        await gathered.submit(0)  # alone: written at once, not held back for company
        first = asyncio.ensure_future(gathered.submit(1))
        await asyncio.sleep(0)  # its round has started
        await asyncio.gather(first, *(gathered.submit(n) for n in range(2, 51)))

    async_to_sync(scenario)()
    assert rounds == [[0], [1], list(range(2, 51))]


@pytest.mark.django_db(transaction=True)
def test_a_round_that_fails_fails_each_of_its_writers_and_the_next_round_still_runs():
    calls = []

    def write(*, items):
        calls.append(list(items))
        if -1 in items:
            raise RuntimeError("database away")

    gathered = stream_writes.Gathered(write, "items")

    async def scenario():
        await gathered.submit(0)
        outcomes = await asyncio.gather(*(gathered.submit(n) for n in (-1, 2, 3)), return_exceptions=True)
        assert [type(o) for o in outcomes] == [RuntimeError] * 3
        await gathered.submit(4)

    async_to_sync(scenario)()
    assert calls == [[0], [-1, 2, 3], [4]]


@pytest.mark.django_db(transaction=True)
def test_acknowledgements_in_one_statement_each_as_alone(django_assert_max_num_queries):
    web, db_, old = (connect(make_workload(hostname=h)) for h in ("web", "db", "old"))
    wrong = make_workload(hostname="offline")  # no stream at all
    latest = {w.hostname: w.latest_policy_id for w in (web, db_, old)}
    # One statement on PostgreSQL; SQLite reads each row first, then updates it.
    with django_assert_max_num_queries(1 if connection.vendor == "postgresql" else 8):
        sync.workloads_applied(
            acknowledgements=[
                (web.id, "stream-1", latest["web"]),  # the latest: synced
                (db_.id, "stream-1", "an older version"),  # applied, still pending
                (old.id, "stream-0", latest["old"]),  # not its stream: nothing
                (wrong.id, "stream-1", "x"),
            ]
        )
    rows = {w.hostname: w for w in Workload.objects.all()}
    assert rows["web"].sync_state == "synced" and rows["web"].applied_version == latest["web"]
    assert rows["web"].rank == Workload.RANK_SYNCED
    assert rows["db"].sync_state == "pending" and rows["db"].applied_version == "an older version"
    assert rows["old"].sync_state == "pending" and rows["old"].applied_version == ""
    assert rows["offline"].sync_state == "offline" and rows["offline"].applied_version == ""


@pytest.mark.django_db(transaction=True)
def test_snapshots_marked_in_one_statement_each_as_alone(django_assert_max_num_queries):
    from fleet.streams import streams_snapshots

    web, db_, old = (connect(make_workload(hostname=h)) for h in ("web", "db", "old"))
    Workload.objects.filter(id=db_.id).update(last_snapshot_sent_at=None)
    requests = [
        (web.id, "stream-1", None),  # its latest
        (db_.id, "stream-1", db_.latest_policy_id),  # sent already: nothing
        (old.id, "stream-0", None),  # not its stream: nothing
    ]
    # The marks, then which of the unmarked have no rendered policy yet.
    with django_assert_max_num_queries(2 if connection.vendor == "postgresql" else 4):
        snapshots = streams_snapshots(requests=requests)
    assert snapshots[0].version == web.latest_policy_id
    assert json.loads(snapshots[0].text)["mode"] == "visibility"
    assert snapshots[1:] == [None, None]
    assert Workload.objects.get(id=db_.id).last_snapshot_sent_at is None
    # A workload without a rendered policy yet is rendered first, as alone.
    new = make_workload(hostname="new", render=False)
    from fleet.sync import workload_stream_opened

    workload_stream_opened(workload_id=new.id, stream_id="stream-9")
    (snapshot,) = streams_snapshots(requests=[(new.id, "stream-9", None)])
    assert snapshot.version == Workload.objects.get(id=new.id).latest_policy_id


@pytest.mark.django_db(transaction=True)
def test_the_sweeps_streams_behind_in_one_statement_each_as_read_whole(django_assert_max_num_queries):
    from fleet.streams import StreamDue, _streams_behind_read, streams_behind

    names = ("synced", "stale", "resend", "revoked", "replaced", "unrendered")
    rows = {name: connect(make_workload(hostname=name), stream_id=name) for name in names}
    at = rows["synced"].enrolled_at
    Workload.objects.filter(pk=rows["resend"].pk).update(resend_requested_at=at)
    Workload.objects.filter(pk=rows["revoked"].pk).update(credential_revoked_at=at)
    Workload.objects.filter(pk=rows["unrendered"].pk).update(latest_policy=None)
    never = make_workload(hostname="never-connected")
    latest = {name: row.latest_policy_id for name, row in rows.items()}
    held = [
        (str(rows["synced"].id), "synced", latest["synced"]),  # up to date
        (str(rows["stale"].id), "stale", "an older version"),
        (str(rows["resend"].id), "resend", latest["resend"]),
        (str(rows["revoked"].id), "revoked", latest["revoked"]),
        (str(rows["replaced"].id), "replaced-before", latest["replaced"]),  # an older stream, still held
        (str(rows["replaced"].id), "replaced", latest["replaced"]),  # and the current one, up to date
        (str(rows["unrendered"].id), "unrendered", None),  # nothing to send yet
        (str(never.id), "never", None),  # it has no stream
        ("00000000-0000-0000-0000-000000000000", "nobody", None),  # no such workload
    ]
    with django_assert_max_num_queries(1 if connection.vendor == "postgresql" else 2):
        behind = streams_behind(held=held)
    assert behind == {
        "stale": StreamDue(latest["stale"], None),
        "resend": StreamDue(latest["resend"], at),
        "revoked": StreamDue(latest["revoked"], None, revoked=True),
        "replaced-before": None,
        "never": None,
        "nobody": None,
    }
    assert _streams_behind_read(held) == behind  # the ORM's reading, SQLite's path, agrees
    assert streams_behind(held=[]) == {}

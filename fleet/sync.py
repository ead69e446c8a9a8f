"""The sync state machine (spec "Sync state"), one function per event of its table, and the
owned-table reports. No other transition exists: an event that the table does not list for the
current state changes nothing but the instant the agent was last heard from.

| from                | event                         | to        |
|---------------------|-------------------------------|-----------|
| any, stream open    | new latest version rendered   | pending   |
| offline             | stream begins                 | pending   |
| pending             | agent applied latest version  | synced    |
| pending or synced   | agent failed to apply latest  | degraded  |
| any connected state | stream ends                   | offline   |

(`degraded` -> `synced` goes through a resend: the stream ends, begins again with a fresh snapshot,
and the agent applies it.) Events carry the id of the stream they came from; events of a stream that
is no longer the workload's open stream are ignored, so a late "stream ended" of an old connection
cannot take a reconnected workload offline.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import Case, Value, When

from controlplane import clock, metrics
from controlplane.problems import Problem
from controlplane.text import visible
from controlplane.webhooks.outbox import webhook_events_record, workload_event
from fleet import health as flow_health
from fleet.choices import OwnedTableState, SyncState
from fleet.models import Workload, workload_column_value
from fleet.push import notify_streams
from fleet.selectors import workload_get


def rank_of(sync_state: str, owned_table_state: str) -> int:
    if sync_state == SyncState.DEGRADED or owned_table_state == OwnedTableState.ABSENT:
        return Workload.RANK_ATTENTION
    return {SyncState.OFFLINE: Workload.RANK_OFFLINE, SyncState.PENDING: Workload.RANK_PENDING}.get(
        sync_state, Workload.RANK_SYNCED
    )


def _locked(workload_id) -> Workload:
    return workload_get(workload_id=workload_id, for_update=True)


def _save(workload: Workload, *fields: str) -> None:
    workload.rank = rank_of(workload.sync_state, workload.owned_table_state)
    workload.save(update_fields=[*fields, "rank"])


# What an agent reports of its owned table; "unknown" (or anything else) is no report.
REPORTED_TABLE_STATES = (OwnedTableState.PRESENT, OwnedTableState.ABSENT)


def _pending_rank() -> Case:
    """`rank_of(PENDING, owned_table_state)` in SQL, for updates of many rows or without a read."""
    return Case(
        When(owned_table_state=OwnedTableState.ABSENT, then=Value(Workload.RANK_ATTENTION)),
        default=Value(Workload.RANK_PENDING),
    )


def _current_stream(workload: Workload, stream_id: str) -> bool:
    return bool(stream_id) and workload.stream_id == stream_id


def latest_version_moved(moved: dict[str, str]) -> None:
    """New latest versions were rendered (workload id -> version). Workloads with an open stream go
    to pending and are told; offline ones keep their state and get the snapshot when they connect."""
    _set_latest_versions(moved)
    connected = list(
        Workload.objects.filter(id__in=list(moved)).exclude(stream_id="").values_list("id", flat=True)
    )
    Workload.objects.filter(id__in=connected).update(
        sync_state=SyncState.PENDING,
        sync_error="",
        rank=_pending_rank(),
    )

    notify_streams([str(i) for i in connected], {"type": "policy.updated"})


def _set_latest_versions(moved: dict[str, str]) -> None:
    if connection.vendor == "postgresql":
        # One statement for the whole fan-out, instead of one per distinct version (thousands).
        table = Workload._meta.db_table
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} AS w SET latest_policy_id = m.version, latest_version_at = %s "  # noqa: S608
                "FROM unnest(%s::uuid[], %s::text[]) AS m(id, version) WHERE w.id = m.id",
                [clock.now(), list(moved), list(moved.values())],
            )
        return
    by_version: dict[str, list[str]] = defaultdict(list)
    for workload_id, version in moved.items():
        by_version[version].append(workload_id)
    now = clock.now()
    for version, ids in by_version.items():
        Workload.objects.filter(id__in=ids).update(latest_policy_id=version, latest_version_at=now)


def workload_stream_opened(
    *,
    workload_id,
    stream_id: str,
    agent_version: str = "",
    gateway: str = "",
    owned_table_state: str | None = None,
) -> None:
    """A sync stream began (the agent proved its key): offline -> pending; the caller sends the
    snapshot next (fleet.streams.stream_snapshot, which records it as sent). `gateway` is the address
    the agent says it dialed ("" from an agent that knows one gateway). `owned_table_state`, present
    or absent as the agent's `auth` reported it, is recorded as `workload_table_reported` would.

    One statement when the agent reports the table state already recorded, or none (nearly every
    reconnect): a survivor takes thousands at once after a failover, and the locked read, the update
    and the commit were three round trips each, queued on the gateway's database threads. A changed
    table state, which sends a webhook event, takes the locked path."""
    fields = {
        "stream_id": stream_id,
        "sync_state": SyncState.PENDING,
        "sync_error": "",
        "last_heard_from": clock.now(),
        "stream_gateway": visible(gateway)[:300],
    }
    if agent_version:
        fields["agent_version"] = visible(agent_version)[:64]  # the agent's free text, escaped
    if _stream_opened_update(workload_id, fields, owned_table_state):
        return
    with transaction.atomic():
        workload = _locked(workload_id)
        for name, value in fields.items():
            setattr(workload, name, value)
        _save(workload, *fields, *_table_reported(workload, owned_table_state))


def _stream_opened_update(workload_id, fields: dict, owned_table_state: str | None) -> bool:
    """`fields` and the pending rank (`_pending_rank`) written in one UPDATE, when the row's table state
    is `owned_table_state` (any, when that is no report); whether a row was updated. Written in SQL: the
    ORM's building of it took more CPU than the statement, thousands of times in a failover."""
    table = Workload._meta.db_table
    columns = ", ".join(f'"{Workload._meta.get_field(name).column}" = %s' for name in fields)
    params = [workload_column_value(name, value) for name, value in fields.items()]
    rank, table_state = (Workload._meta.get_field(name).column for name in ("rank", "owned_table_state"))
    sql = (
        f'UPDATE "{table}" SET {columns}, "{rank}" = CASE WHEN "{table_state}" = %s THEN %s ELSE %s END '  # noqa: S608
        'WHERE "id" = %s'
    )
    params += [
        str(OwnedTableState.ABSENT),
        Workload.RANK_ATTENTION,
        Workload.RANK_PENDING,
        workload_column_value("id", uuid.UUID(str(workload_id))),
    ]
    if owned_table_state in REPORTED_TABLE_STATES:
        sql += f' AND "{table_state}" = %s'
        params.append(str(owned_table_state))
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount > 0


def workload_applied(*, workload_id, stream_id: str, version: str) -> None:
    """The agent applied `version`: pending -> synced when it is the latest."""
    workloads_applied(acknowledgements=[(workload_id, stream_id, version)])


def workloads_applied(*, acknowledgements: list[tuple]) -> None:
    """Agents applied versions, each (workload id, stream id, version) as `workload_applied` says, in
    one statement on PostgreSQL: thousands of agents acknowledge at once after a fleet-wide change
    (fleet/stream_writes.py gathers them), and building the same statement with the ORM's Case/When
    cost a third of the gateway's Python time in the 2,000-agent benchmark.

    Each acknowledgement from a stream that is still its workload's moves it pending -> synced when
    its version is the latest. The agent's text is escaped: it is shown beside the latest, and
    PostgreSQL refuses a NUL even to compare (a version we rendered, hex, is unchanged by it)."""
    acknowledged = [
        (workload_column_value("id", uuid.UUID(str(workload_id))), stream_id, visible(version)[:80])
        for workload_id, stream_id, version in acknowledgements
        if stream_id
    ]
    if not acknowledged:
        return
    table = Workload._meta.db_table
    becomes_synced = "w.sync_state = %s AND w.latest_policy_id = m.version"
    now = workload_column_value("last_heard_from", clock.now())
    if connection.vendor != "postgresql":
        for key, stream_id, version in acknowledged:
            _applied_one(table, key, stream_id, version, now)
        return
    # What was applied before, and when the latest version moved (the time to a first
    # acknowledgement is a metric): the FROM's read of the table sees the rows before the update.
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} AS w SET applied_version = m.version, last_heard_from = %s, "  # noqa: S608
            f"sync_state = CASE WHEN {becomes_synced} THEN %s ELSE w.sync_state END, "
            f"rank = CASE WHEN {becomes_synced} AND w.owned_table_state <> %s THEN %s ELSE w.rank END "
            f"FROM (SELECT m.id, m.stream_id, m.version, p.applied_version AS was "
            f"FROM unnest(%s::uuid[], %s::text[], %s::text[]) AS m(id, stream_id, version) "
            f"JOIN {table} AS p ON p.id = m.id) AS m "
            "WHERE w.id = m.id AND w.stream_id = m.stream_id "
            "RETURNING m.version, m.was, w.latest_policy_id, w.latest_version_at",
            [
                now,
                SyncState.PENDING, SyncState.SYNCED,
                SyncState.PENDING, OwnedTableState.ABSENT, Workload.RANK_SYNCED,
                *(list(column) for column in zip(*acknowledged, strict=True)),
            ],
        )  # fmt: skip
        for version, *before in cursor.fetchall():
            metrics.policy_applied(version=version, before=tuple(before))


def _applied_one(table: str, key, stream_id: str, version: str, now) -> None:
    # SQLite: what was applied before read just before the update (it cannot return a FROM's columns).
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT applied_version, latest_policy_id, latest_version_at FROM {table} WHERE id = %s",  # noqa: S608
            [key],
        )
        before = cursor.fetchone()
        cursor.execute(
            f"UPDATE {table} SET applied_version = %s, last_heard_from = %s, "  # noqa: S608
            "sync_state = CASE WHEN sync_state = %s AND latest_policy_id = %s THEN %s ELSE sync_state END, "
            "rank = CASE WHEN sync_state = %s AND latest_policy_id = %s AND owned_table_state <> %s "
            "THEN %s ELSE rank END WHERE id = %s AND stream_id = %s",
            [
                version, now,
                SyncState.PENDING, version, SyncState.SYNCED,
                SyncState.PENDING, version, OwnedTableState.ABSENT, Workload.RANK_SYNCED,
                key, stream_id,
            ],
        )  # fmt: skip
        if cursor.rowcount == 1 and before is not None:
            metrics.policy_applied(version=version, before=before)


def workload_apply_failed(*, workload_id, stream_id: str, version: str, error: str) -> Workload:
    """Applying `version` failed on the host, which keeps its previous table: pending or synced ->
    degraded, with the error, when it is the latest version."""
    with transaction.atomic():
        workload = _locked(workload_id)
        if not _current_stream(workload, stream_id):
            return workload
        workload.last_heard_from = clock.now()
        if (
            workload.sync_state in (SyncState.PENDING, SyncState.SYNCED)
            and version == workload.latest_policy_id
        ):
            was = workload.sync_state
            workload.sync_state = SyncState.DEGRADED
            workload.sync_error = (
                visible(error, keep="\n\t")[:4000] or "the agent reported a failure without an error text"
            )
            webhook_events_record(
                [
                    workload_event(
                        "workload.degraded", workload, was=was, version=version, error=workload.sync_error
                    )
                ]
            )
        _save(workload, "last_heard_from", "sync_state", "sync_error")
    return workload


def workload_stream_ended(
    *, workload_id, stream_id: str, last_heartbeat: tuple[str, datetime] | None = None
) -> Workload | None:
    """The control plane recorded the end of the stream: any connected state -> offline.

    `last_heartbeat` is the stream's last heartbeat (its process and when it arrived). Heartbeats are
    written at most once a minute, so without it an agent killed in a quiet spell would look silent
    from up to a minute before it died (the agent_silent gap would start that much too early)."""
    with transaction.atomic():
        workload = Workload.objects.select_for_update().filter(id=workload_id).first()
        if workload is None or not _current_stream(workload, stream_id):
            return workload
        heard_before = workload.last_heard_from
        workload.stream_id = ""
        workload.sync_state = SyncState.OFFLINE
        workload.last_heard_from = clock.now()
        webhook_events_record([_offline_event(workload, heard_before)])
        # Known only from a live stream's heartbeats; offline, silence and reports decide coverage.
        workload.flow_backlog_since = None
        fields = ["stream_id", "sync_state", "last_heard_from", "flow_backlog_since"]
        if last_heartbeat is not None:
            fields += _flow_process_seen(workload, *last_heartbeat)
        _save(workload, *fields)
    return workload


def _offline_event(workload: Workload, heard_before: datetime | None):
    """`workload.offline`, with how long nobody had heard from it (the reaper ends streams silent for
    minutes; an agent that closed its stream was heard from a moment ago)."""
    silent = (workload.last_heard_from - heard_before).total_seconds() if heard_before else None
    return workload_event(
        "workload.offline",
        workload,
        last_heard_from=clock.rfc3339(heard_before),
        silent_seconds=None if silent is None else round(max(silent, 0.0), 3),
    )


def _table_events(before: str, after: str, workload: Workload) -> list:
    """Enforcement removed (the owned table gone from the kernel) or restored, on a change only."""
    if before == after:
        return []
    if after == OwnedTableState.ABSENT:
        return [workload_event("workload.enforcement_removed", workload, owned_table_state=after)]
    if before == OwnedTableState.ABSENT:
        return [workload_event("workload.enforcement_restored", workload, owned_table_state=after)]
    return []


def _table_reported(workload: Workload, state: str | None) -> list[str]:
    """The owned table's state as the agent reports it (present or absent; anything else is no
    report), with the webhook event of a change. Returns the fields it changed."""
    if state not in REPORTED_TABLE_STATES:
        return []
    webhook_events_record(_table_events(workload.owned_table_state, state, workload))
    workload.owned_table_state = state
    return ["owned_table_state"]


def _flow_process_seen(workload: Workload, process_start_id: str | None, at: datetime) -> list[str]:
    """A sign of life of an agent process at `at`: if it is the process that sent the last flow report,
    that process ran until then (a quiet workload, not a silent one). Returns the fields it changed."""
    alive_at = flow_health.process_seen(
        process=process_start_id,
        at=at,
        reporting_process=workload.flow_process_start_id,
        alive_at=workload.flow_process_alive_at,
    )
    if alive_at is None:
        return []
    workload.flow_process_alive_at = alive_at
    return ["flow_process_alive_at"]


KEEP = object()  # a heartbeat field left as it was (a table report carries no flow backlog)


def workload_heard_from(
    *,
    workload_id,
    stream_id: str,
    owned_table_state: str | None = None,
    process_start_id: str | None = None,
    flow_backlog_since: datetime | None | object = KEEP,
) -> None:
    """A heartbeat: the agent is alive; it may report whether its owned table is in the kernel, and
    since when it holds flow evidence not delivered yet. A heartbeat of the process that sent the last
    flow report shows that process still running (a quiet workload, not a silent one)."""
    with transaction.atomic():
        workload = _locked(workload_id)
        if not _current_stream(workload, stream_id):
            return
        workload.last_heard_from = clock.now()
        fields = [
            "last_heard_from",
            *_flow_process_seen(workload, process_start_id, workload.last_heard_from),
        ]
        if flow_backlog_since is not KEEP:
            workload.flow_backlog_since = flow_backlog_since
            fields.append("flow_backlog_since")
        fields += _table_reported(workload, owned_table_state)
        _save(workload, *fields)


def workload_alive(*, workload_id, stream_id: str, process_start_id: str | None = None) -> None:
    """A heartbeat that reports nothing new (the same table state, the same flow backlog): the agent is
    alive, and so is its reporting process if it sent it (`_flow_process_seen`). One statement, with no
    lock taken first: a fleet of 10,000 agents sends about 170 of them a second, and the locked
    read-then-save of `workload_heard_from` was most of serve's CPU while it held them idle."""
    if not stream_id:
        return
    table = Workload._meta.db_table
    now = workload_column_value("flow_process_alive_at", clock.now())
    process = process_start_id or ""
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET last_heard_from = %s, flow_process_alive_at = CASE WHEN "  # noqa: S608
            "%s <> '' AND flow_process_start_id = %s AND (flow_process_alive_at IS NULL OR flow_process_alive_at < %s) "
            "THEN %s ELSE flow_process_alive_at END WHERE id = %s AND stream_id = %s",
            [now, process, process, now, now, workload_column_value("id", uuid.UUID(str(workload_id))), stream_id],
        )  # fmt: skip


def workload_table_reported(*, workload_id, stream_id: str, state: str) -> None:
    """The agent reports its owned table gone from the kernel (`absent`) or back (`present`).
    Enforcement removed is independent of the sync state, which keeps recording the last ack."""
    if state not in REPORTED_TABLE_STATES:
        raise Problem("malformed-request", f"owned table state must be absent or present, not {state!r}")
    workload_heard_from(workload_id=workload_id, stream_id=stream_id, owned_table_state=state)


def workload_table_modified(
    *, workload_id, stream_id: str, modified_at: datetime, restored_at: datetime | None, description: str
) -> bool:
    """The agent saw another process edit its owned table and put its applied document back: the
    workload keeps the last such edit (`health.owned_table`), and `workload.table_modified` is sent.
    The same report again (a resend after a reconnect) changes nothing; returns whether it was new."""
    description = visible(description)[: Workload._meta.get_field("table_modification").max_length]
    with transaction.atomic():
        workload = _locked(workload_id)
        if not _current_stream(workload, stream_id):
            return False
        workload.last_heard_from = clock.now()
        repeated = workload.table_modified_at == modified_at and workload.table_restored_at == restored_at
        if repeated:
            _save(workload, "last_heard_from")
            return False
        workload.table_modified_at, workload.table_restored_at = modified_at, restored_at
        workload.table_modification = description
        webhook_events_record(
            [
                workload_event(
                    "workload.table_modified",
                    workload,
                    modified_at=clock.rfc3339(modified_at),
                    restored_at=clock.rfc3339(restored_at),
                    description=description,
                )
            ]
        )
        metrics.owned_table_modified(restored=restored_at is not None)
        _save(workload, "last_heard_from", "table_modified_at", "table_restored_at", "table_modification")
    return True


def workload_streams_reap(*, silent_for: timedelta) -> int:
    """Record as ended the streams nobody has heard from for `silent_for`: their serve process died
    without recording them (a crash, a kill). Live streams are heard from with every heartbeat."""
    cutoff = clock.now() - silent_for
    stale = (
        Workload.objects.exclude(stream_id="")
        .filter(last_heard_from__lt=cutoff)
        .values_list("id", "stream_id")
    )
    ended = 0
    for workload_id, stream_id in list(stale):
        if workload_stream_ended(workload_id=workload_id, stream_id=stream_id):
            ended += 1
    return ended

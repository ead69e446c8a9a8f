"""What the gateway decides about a sync stream, as domain functions (the consumer only moves frames):
who may open one, and the snapshot it sends."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import lru_cache

from django.db import connection

from agent import protocol
from controlplane import clock
from controlplane.service_identity import gateway_identity
from fleet.credentials import (
    credential_beyond_grace,
    credential_names,
    credential_renewal_due_at,
    credential_state,
    workload_key,
)
from fleet.models import RenderedPolicy, Workload, workload_column_value, workload_from_row, workload_reading
from fleet.rendering import workloads_rerender
from fleet.sync import workload_stream_opened


class StreamRefused(Exception):
    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class StreamGrant:
    workload_id: str
    hostname: str
    renew_only: bool
    welcome: protocol.Welcome


def gateway_fingerprint() -> str:
    """The fingerprint of the certificate this gateway serves, which agents bind their proofs to."""
    return gateway_identity().fingerprint


def _credential_holder(workload_id: str, credential: str) -> Workload | None:
    """The workload, when `credential` is one this control plane signed for it, naming the key it is
    enrolled with, at its current serial; None otherwise (expiry is the caller's to judge)."""
    key = workload_key(workload_id)
    if key is None:
        return None
    # The row read in SQL and made into the ORM's instance (fleet/models.py `workload_reading`): a
    # failover's survivor authenticates thousands of streams at once.
    reading = workload_reading(connection.vendor)
    with connection.cursor() as cursor:
        cursor.execute(
            f'SELECT {reading.columns} FROM "{Workload._meta.db_table}" WHERE "id" = %s',  # noqa: S608
            [workload_column_value("id", key)],
        )
        row = cursor.fetchone()
    workload = None if row is None else workload_from_row(reading, row)
    if workload is None or not credential_names(
        credential, workload_id=workload.id, public_key=workload.public_key, serial=workload.credential_serial
    ):
        return None
    return workload


def stream_authenticate(*, auth: protocol.Auth, nonce: bytes) -> StreamGrant:
    """Check an `auth` message: the credential is ours, names this workload and the key it is enrolled
    with, is its current serial, and the proof signs this stream's nonce with that key. An expired
    credential within its grace may only renew; beyond it the workload must re-enrol."""
    workload = _credential_holder(auth.workload_id, auth.credential)
    if workload is None:
        raise StreamRefused(protocol.CLOSE_UNAUTHENTICATED, "unknown workload, or not its current credential")
    fingerprint = gateway_fingerprint()
    if not protocol.verify_proof(
        workload.public_key,
        auth.proof,
        nonce=nonce,
        workload_id=str(workload.id),
        gateway_fingerprint=fingerprint,
    ):
        raise StreamRefused(protocol.CLOSE_UNAUTHENTICATED, "proof of possession failed")
    if workload.credential_revoked_at is not None:
        raise StreamRefused(
            protocol.CLOSE_CREDENTIAL_REVOKED,
            "credential revoked by the operator: re-enrol with a token for it",
        )
    now = clock.now()
    if credential_beyond_grace(workload, now):
        raise StreamRefused(protocol.CLOSE_FORBIDDEN, "credential expired beyond its grace: re-enrol")
    state = credential_state(workload, now)
    welcome = protocol.Welcome(
        workload_id=str(workload.id),
        credential_state=state,
        expires_at=clock.rfc3339(workload.credential_expires_at),
        renewal_due_at=clock.rfc3339(credential_renewal_due_at(workload)),
        renew_only=state == "expired",
    )
    return StreamGrant(
        workload_id=str(workload.id),
        hostname=workload.hostname,
        renew_only=state == "expired",
        welcome=welcome,
    )


def stream_open(*, auth: protocol.Auth, nonce: bytes, stream_id: str, gateway: str = "") -> StreamGrant:
    """`stream_authenticate`, then the stream recorded as the workload's (`workload_stream_opened`)
    unless its credential may only renew: one trip to a gateway database thread for both, and two
    statements, where a survivor of a failover takes thousands of streams at once."""
    grant = stream_authenticate(auth=auth, nonce=nonce)
    if not grant.renew_only:
        workload_stream_opened(
            workload_id=grant.workload_id,
            stream_id=stream_id,
            agent_version=auth.agent_version,
            gateway=gateway,
            owned_table_state=auth.owned_table,
        )
    return grant


@dataclass(frozen=True)
class StreamSnapshot:
    """A snapshot as it goes on the stream: its version, and the `snapshot` message's text."""

    version: str
    text: str


@lru_cache(maxsize=256)
def _snapshot_text(version: str, mode: str) -> str:
    # A version is the hash of its document: what it names never changes, so every stream of this
    # process sends one copy, read once (~100 KB from the database) and encoded once (110 us for a
    # small document: after a fleet-wide change thousands of streams send the same few).
    policy = RenderedPolicy.objects.get(version=version)
    return protocol.Snapshot(
        version=version, mode=mode, document=policy.document, rule_index=dict(policy.rule_index)
    ).encode()


def stream_snapshot(
    *, workload_id: str, stream_id: str, unless_version: str | None = None
) -> StreamSnapshot | None:
    """The workload's latest rendered policy (rendering it first if it has none yet), recorded as
    sent on this stream. None when this is no longer the workload's stream, or when its latest
    version is `unless_version`, already sent."""
    return streams_snapshots(requests=[(workload_id, stream_id, unless_version)])[0]


def streams_snapshots(*, requests: list[tuple]) -> list[StreamSnapshot | None]:
    """`stream_snapshot` for each (workload id, stream id, unless version), the marks in one statement
    on PostgreSQL: after a fleet-wide change every stream of the process asks at once
    (fleet/stream_writes.py gathers them)."""
    marked = _latest_marked_sent(requests)
    unmarked = [request for request, mark in zip(requests, marked, strict=True) if mark is None]
    bare = set()
    if unmarked:
        bare = set(
            Workload.objects.filter(id__in=[r[0] for r in unmarked], latest_policy__isnull=True).values_list(
                "id", flat=True
            )
        )
    unrendered = [request for request in unmarked if uuid.UUID(str(request[0])) in bare]
    if unrendered:
        workloads_rerender(workload_ids=[str(request[0]) for request in unrendered])
        again = dict(zip(unrendered, _latest_marked_sent(unrendered), strict=True))
        marked = [again.get(request, mark) for request, mark in zip(requests, marked, strict=True)]
    return [None if mark is None else _snapshot(*mark) for mark in marked]


def _snapshot(version: str, mode: str) -> StreamSnapshot | None:
    try:
        return StreamSnapshot(version, _snapshot_text(version, mode))
    except RenderedPolicy.DoesNotExist:
        # The latest version moved on between the two reads and fleet.retention removed this one;
        # the newer snapshot follows with the notification of that change.
        return None


def _latest_marked_sent(requests: list[tuple]) -> list[tuple[str, str] | None]:
    # One statement for all, since every stream of the fleet asks after a fleet-wide change: stamp
    # last_snapshot_sent_at, answer a pending resend, and read the version and mode to send.
    table = Workload._meta.db_table
    now = workload_column_value("last_snapshot_sent_at", clock.now())
    keys = [
        (workload_column_value("id", uuid.UUID(str(workload_id))), stream_id, unless or "")
        for workload_id, stream_id, unless in requests
    ]
    with connection.cursor() as cursor:
        if connection.vendor != "postgresql":
            marked = []
            for key, stream_id, unless in keys:
                cursor.execute(
                    f"UPDATE {table} SET last_snapshot_sent_at = %s, resend_requested_at = NULL "  # noqa: S608
                    "WHERE id = %s AND stream_id = %s AND latest_policy_id IS NOT NULL "
                    "AND latest_policy_id <> %s RETURNING latest_policy_id, mode",
                    [now, key, stream_id, unless],
                )
                row = cursor.fetchone()
                marked.append((row[0], row[1]) if row else None)
            return marked
        cursor.execute(
            f"UPDATE {table} AS w SET last_snapshot_sent_at = %s, resend_requested_at = NULL "  # noqa: S608
            "FROM unnest(%s::uuid[], %s::text[], %s::text[]) AS m(id, stream_id, unless) "
            "WHERE w.id = m.id AND w.stream_id = m.stream_id AND w.latest_policy_id IS NOT NULL "
            "AND w.latest_policy_id <> m.unless RETURNING w.id, m.stream_id, w.latest_policy_id, w.mode",
            [now, *(list(column) for column in zip(*keys, strict=True))],
        )
        found = {
            (workload_id, stream_id): (version, mode) for workload_id, stream_id, version, mode in cursor
        }
    return [found.get((uuid.UUID(str(workload_id)), stream_id)) for workload_id, stream_id, _ in requests]


@dataclass(frozen=True)
class StreamDue:
    latest_version: str | None
    resend_requested_at: object  # a datetime, or None when no resend waits for a snapshot
    revoked: bool = False  # the operator revoked the credential: the stream must close


def streams_behind(*, held: list[tuple[str, str, str | None]]) -> dict[str, StreamDue | None]:
    """(workload id, stream id, version sent on it) in; out, the streams that are behind their
    workload, by stream id: None for one that is no longer its workload's open stream, else what its
    workload expects of it (a latest version not sent, an unanswered resend, a revoked credential).

    serve's sweep asks this for every stream it holds every two seconds. On PostgreSQL the comparison
    is made in one statement that returns only the streams behind, usually none: read whole, 10,000
    held streams were 20 ORM queries of 500 ids and 10,000 rows a sweep, the largest cost of a fleet
    held idle (py-spy: 18 % of serve's samples)."""
    if not held:
        return {}
    if connection.vendor != "postgresql":
        return _streams_behind_read(held)
    table = Workload._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT h.stream_id, w.id IS NOT NULL AND w.stream_id = h.stream_id, w.latest_policy_id, "  # noqa: S608
            "w.resend_requested_at, w.credential_revoked_at IS NOT NULL "
            "FROM unnest(%s::text[], %s::text[], %s::text[]) AS h(id, stream_id, sent) "
            f"LEFT JOIN {table} AS w ON w.id = h.id::uuid "
            "WHERE w.id IS NULL OR w.stream_id <> h.stream_id OR w.credential_revoked_at IS NOT NULL "
            "OR w.resend_requested_at IS NOT NULL "
            "OR (w.latest_policy_id IS NOT NULL AND w.latest_policy_id IS DISTINCT FROM h.sent)",
            [
                [str(workload_id) for workload_id, _, _ in held],  # cast by PostgreSQL, not made here
                [stream_id for _, stream_id, _ in held],
                [sent for _, _, sent in held],
            ],
        )
        return {
            stream_id: StreamDue(latest, resend_at, revoked) if still else None
            for stream_id, still, latest, resend_at, revoked in cursor
        }


def _streams_behind_read(held: list[tuple[str, str, str | None]]) -> dict[str, StreamDue | None]:
    # Every held stream's row read through the ORM and compared here: SQLite's path, and the
    # reference the statement above is tested against.
    on_workload: dict[str, list[tuple[str, str | None]]] = {}
    for workload_id, stream_id, sent in held:
        on_workload.setdefault(str(workload_id), []).append((stream_id, sent))
    behind: dict[str, StreamDue | None] = {stream_id: None for _, stream_id, _ in held}
    ids = list(on_workload)
    for start in range(0, len(ids), 500):  # under SQLite's bound-parameter limit
        rows = Workload.objects.filter(id__in=ids[start : start + 500]).values_list(
            "id", "stream_id", "latest_policy_id", "resend_requested_at", "credential_revoked_at"
        )
        for workload_id, stream_id, latest, resend_at, revoked_at in rows:
            for held_stream, sent in on_workload[str(workload_id)]:
                if held_stream != stream_id:
                    continue  # no longer its workload's stream: stays None
                due = StreamDue(latest, resend_at, revoked_at is not None)
                if due.revoked or resend_at is not None or (latest and latest != sent):
                    behind[held_stream] = due
                else:
                    del behind[held_stream]
    return behind

"""The agent gateway: enrolment over HTTPS and the sync stream over a websocket.

The consumer only moves frames: it decodes them with agent.protocol and calls the fleet's domain
functions. A malformed or unexpected frame closes the stream with its 4xxx code and a log line; it
never changes state and never takes the process down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from datetime import datetime

from channels.consumer import get_handler_name
from channels.generic.websocket import AsyncWebsocketConsumer
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from agent import protocol
from controlplane import clock, metrics
from controlplane.outage import database_busy, database_failed, retry_after_seconds
from controlplane.problems import Finding, Problem, ValidationFailed
from controlplane.text import visible
from controlplane.validation import parse_instant, require_object
from fleet import credentials, held_streams, stream_writes, streams, sync
from fleet.admission import stream_admission
from fleet.credentials import signing_public_key
from fleet.enrolment import workload_enrol
from fleet.push import stream_group
from fleet.stream_layer import LayerIndependentConsumer

log = logging.getLogger("palisade.gateway")


AUTH_TIMEOUT_SECONDS = 10
HEARD_FROM_EVERY_SECONDS = 60  # heartbeats refresh last_heard_from at most this often
# A stream's channel-layer memberships are joined again this often: the layer expires them after a
# day (channels' group_expiry), and each join is two Redis round trips (10,000 streams joining every
# minute were 330 a second).
GROUPS_REFRESH_SECONDS = 3600
BUSY_REASON = "busy: too many streams authenticating"  # then ": retry after N s" (docs/protocol.md)
# A snapshot unanswered this long no longer holds back the next one: an agent stuck that long gains
# nothing from waiting, and must not be left on an old version for good.
SNAPSHOT_ANSWER_SECONDS = 60
metrics.stream_authentications_follow(lambda: stream_admission().in_progress)


class EnrolView(APIView):
    """POST /agent/v1/enrol: a provisioning token (or, re-enrolling, a key proof) and the agent's
    public key -> a workload and its credential. Refusals are problem documents like everywhere else."""

    authentication_classes: list = []
    permission_classes = [AllowAny]

    def post(self, request):
        data = require_object(request.data)
        if data.get("v") != protocol.PROTOCOL_VERSION:
            raise ValidationFailed(
                [
                    Finding(
                        "/v",
                        "protocol-version",
                        f"This gateway speaks agent protocol {protocol.PROTOCOL_VERSION}.",
                    )
                ]
            )
        try:
            enrolled = workload_enrol(
                token_secret=str(data.get("token") or ""),
                public_key=data.get("public_key"),
                hostname=data.get("hostname"),
                addresses=data.get("addresses"),
                agent_version=str(data.get("agent_version") or "")[:64],
                workload_id=data.get("workload_id"),
                key_proof=data.get("key_proof"),
            )
        except Problem as refused:
            # A refused enrolment changes nothing and so leaves no audit event: the log says who tried.
            if refused.name != "validation":
                log.warning(
                    "refused an enrolment from %s%s: %s [%s]",
                    request.META.get("REMOTE_ADDR", "?"),
                    f" for workload {data.get('workload_id')!r:.60}" if data.get("workload_id") else "",
                    refused.detail[:300],
                    refused.name,
                )
            raise
        credential = enrolled.credential
        log.info(
            "%s workload %s (%s)",
            "re-enrolled" if enrolled.re_enrolled else "enrolled",
            enrolled.workload.id,
            enrolled.workload.hostname,
        )
        body = protocol.EnrolResponse(
            workload_id=str(enrolled.workload.id),
            credential=credential.text,
            signing_public_key=signing_public_key(),
            expires_at=clock.rfc3339(credential.expires_at),
            renewal_due_at=clock.rfc3339(credential.renewal_due_at),
        )
        return Response(body.to_dict(), status=201)


class SyncStreamConsumer(LayerIndependentConsumer, AsyncWebsocketConsumer):
    """One agent's sync stream. States: awaiting `auth`, renew-only, streaming.

    The stream does not depend on the channel layer (fleet.stream_layer): with Redis away it stays
    open, and the catch-up sweep brings it the changes notifications cannot.
    """

    async def dispatch(self, message):
        # Channels closes the loop thread's old database connections before every frame and event,
        # a thread hop each. This consumer never touches the database from the loop's thread (every
        # call goes through held_streams.db, which looks after its own connections), so the hop is skipped.
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        try:
            await handler(message)
        except Exception as error:
            if not database_failed("serve agent streams", error, log):
                raise
            # Without the database (away, or busy past the wait) the stream can neither authenticate
            # nor record what the agent says: it ends, and the agent comes back when told (its table
            # stays as it is) and says it again.
            self.database_away = True
            wait = retry_after_seconds()
            what = "database busy" if database_busy(error) else "database unavailable"
            await self.close(code=protocol.CLOSE_SHUTDOWN, reason=f"{what}: retry after {wait} s")

    async def connect(self):
        self.admitted = False
        self.turned_away = False
        wait = stream_admission().enter(self)
        if wait is not None:
            self.turned_away = True
            # As many authentications in progress as this process admits: refused before any database
            # or signature work, and told when to come back (spaced from the others refused).
            metrics.stream_admission_refused()
            await self.accept()
            await self.close(code=protocol.CLOSE_SHUTDOWN, reason=f"{BUSY_REASON}: retry after {wait} s")
            return
        self.admitted = True
        self.nonce = os.urandom(32)
        self.stream_id = uuid.uuid4().hex
        self.grant: streams.StreamGrant | None = None
        self.sent_version: str | None = None
        # One snapshot unanswered at a time (docs/protocol.md): its version and when it left, and
        # whether a newer latest version waits for its answer.
        self.unanswered: tuple[str, float] | None = None
        self.update_waiting = False
        self.heard_at = 0.0
        self.groups_refreshed_at = time.monotonic()
        self.last_heartbeat: tuple[str, datetime] | None = None  # its process, when it arrived
        self.table_state: str | None = None
        self.flow_backlog_since: datetime | None = None
        await self.accept()
        await self.send_message(
            protocol.Hello(nonce=protocol.b64encode(self.nonce), server_time=clock.rfc3339(clock.now()))
        )
        self.auth_timer = asyncio.get_running_loop().call_later(AUTH_TIMEOUT_SECONDS, self._auth_timeout)

    def _auth_timeout(self):
        if self.grant is None:
            asyncio.ensure_future(
                self.refuse(protocol.CLOSE_HANDSHAKE_TIMEOUT, "no auth within the handshake time")
            )

    async def send_message(self, message: protocol.Message) -> None:
        await self.send(text_data=message.encode())

    async def refuse(self, code: int, reason: str) -> None:
        peer = self.scope.get("client") or ("?", 0)
        who = self.grant.hostname if self.grant else "unauthenticated agent"
        log.warning("closing stream of %s from %s: %s (%s)", who, peer[0], reason, code)
        await self.close(code=code)

    async def receive(self, text_data=None, bytes_data=None):
        if self.turned_away:
            return  # closing already: whatever the client sends meanwhile is not read
        try:
            message = protocol.decode(text_data if text_data is not None else bytes_data, sender="agent")
            await self.dispatch_message(message)
        except protocol.ProtocolError as error:
            await self.refuse(error.code, error.reason)
        except streams.StreamRefused as refused:
            await self.refuse(refused.code, refused.reason)

    async def dispatch_message(self, message: protocol.Message) -> None:
        if self.grant is None:
            if not isinstance(message, protocol.Auth):
                raise protocol.ProtocolError(protocol.CLOSE_UNEXPECTED, f"expected auth, got {message.type}")
            await self.authenticate(message)
            return
        if isinstance(message, protocol.Renew):
            await self.renew()
            return
        if self.grant.renew_only:
            raise protocol.ProtocolError(
                protocol.CLOSE_UNEXPECTED, f"credential expired: only renew is allowed, got {message.type}"
            )
        handler = {
            protocol.Applied: self.on_applied,
            protocol.Failed: self.on_failed,
            protocol.Heartbeat: self.on_heartbeat,
            protocol.TableState: self.on_table,
            protocol.TableModified: self.on_table_modified,
            protocol.RenewalFailed: self.on_renewal_failed,
        }.get(type(message))
        if handler is None:
            raise protocol.ProtocolError(protocol.CLOSE_UNEXPECTED, f"{message.type} is not expected now")
        await handler(message)

    async def authenticate(self, auth: protocol.Auth) -> None:
        grant = await held_streams.db(streams.stream_open)(
            auth=auth, nonce=self.nonce, stream_id=self.stream_id, gateway=auth.gateway or ""
        )
        self.auth_timer.cancel()
        self.grant = grant
        self.authentication_ended(completed=True)
        if not grant.renew_only:
            # Recorded open: from here its end is recorded too, whatever happens next.
            held = held_streams.open_streams[self.channel_name] = held_streams.HeldStream(
                grant.workload_id, self.stream_id
            )
        held_streams.fleet_receiver_ensure()  # notifications of many workloads reach this process
        self.table_state = auth.owned_table if auth.owned_table in sync.REPORTED_TABLE_STATES else None
        # An older stream of the same workload (a reconnect the server has not noticed) gives way.
        await self.join_group(
            stream_group(grant.workload_id), announce={"type": "stream.replaced", "stream_id": self.stream_id}
        )
        await self.send_message(grant.welcome)
        if grant.renew_only:
            log.info("stream of %s: credential expired, renew only", grant.hostname)
            return
        if auth.gateway is not None:
            # An agent that names the gateway it dialed keeps a list: it gets the current one.
            held.sent_gateways = await held_streams.gateways_advertised()
            await self.send_message(protocol.Gateways(addresses=list(held.sent_gateways)))
        log.info("stream of %s opened (agent %s)", grant.hostname, visible(auth.agent_version))
        await self.send_snapshot()

    async def send_snapshot(self, *, unless_version: str | None = None) -> None:
        snapshot = await stream_writes.snapshots.submit(
            (self.grant.workload_id, self.stream_id, unless_version)
        )
        if snapshot is None:
            return
        await self.send(text_data=snapshot.text)
        self.sent_version = snapshot.version
        self.unanswered = (snapshot.version, time.monotonic())
        held = held_streams.open_streams.get(self.channel_name)
        if held is not None:
            held.sent_version = snapshot.version

    async def on_applied(self, message: protocol.Applied) -> None:
        await stream_writes.applied.submit((self.grant.workload_id, self.stream_id, message.version))
        await self.snapshot_answered(message.version)

    async def snapshot_answered(self, version: str) -> None:
        """The agent answered the snapshot of `version`: the latest goes next if it moved meanwhile."""
        if self.unanswered is None or self.unanswered[0] != version:
            return
        self.unanswered = None
        if self.update_waiting:
            self.update_waiting = False
            await self.send_snapshot(unless_version=self.sent_version)

    async def on_failed(self, message: protocol.Failed) -> None:
        log.warning(
            "%s failed to apply %s: %s",
            self.grant.hostname,
            visible(message.version),
            message.error.splitlines()[0:1],
        )
        await held_streams.db(sync.workload_apply_failed)(
            workload_id=self.grant.workload_id,
            stream_id=self.stream_id,
            version=message.version,
            error=message.error,
        )
        await self.snapshot_answered(message.version)

    async def on_heartbeat(self, message: protocol.Heartbeat) -> None:
        state = message.owned_table if message.owned_table in sync.REPORTED_TABLE_STATES else None
        self.last_heartbeat = (message.process_start_id, clock.now())
        backlog = None
        if message.flow_backlog_since is not None:
            backlog = parse_instant(message.flow_backlog_since)
            if backlog is None:
                raise protocol.ProtocolError(
                    protocol.CLOSE_MALFORMED, "flow_backlog_since must be an RFC 3339 instant or null"
                )
        now = time.monotonic()
        # A backlog that appears or clears is written at once: coverage reads it.
        changed = state != self.table_state or backlog != self.flow_backlog_since
        if now - self.groups_refreshed_at >= GROUPS_REFRESH_SECONDS:
            # Group memberships expire after a day; a stream may live for months.
            self.groups_refreshed_at = now
            self.refresh_groups()
        if changed or now - self.heard_at >= HEARD_FROM_EVERY_SECONDS:
            try:
                if changed:
                    await held_streams.db(sync.workload_heard_from)(
                        workload_id=self.grant.workload_id,
                        stream_id=self.stream_id,
                        owned_table_state=state,
                        process_start_id=message.process_start_id,
                        flow_backlog_since=backlog,
                    )
                else:
                    await held_streams.db(sync.workload_alive)(
                        workload_id=self.grant.workload_id,
                        stream_id=self.stream_id,
                        process_start_id=message.process_start_id,
                    )
            except Exception as error:
                if not database_busy(error):
                    raise
                # The database busy past the wait (a long write): a heartbeat records nothing that the
                # next one does not, so the stream stays up and the next heartbeat writes it all.
                database_failed("record heartbeats", error, log)
                return
            self.heard_at, self.table_state, self.flow_backlog_since = now, state, backlog

    async def on_table(self, message: protocol.TableState) -> None:
        if message.state not in sync.REPORTED_TABLE_STATES:
            raise protocol.ProtocolError(protocol.CLOSE_MALFORMED, "table state must be present or absent")
        self.table_state = message.state
        log.info("%s reports its owned table %s", self.grant.hostname, message.state)
        await held_streams.db(sync.workload_table_reported)(
            workload_id=self.grant.workload_id, stream_id=self.stream_id, state=message.state
        )

    async def on_table_modified(self, message: protocol.TableModified) -> None:
        modified_at = parse_instant(message.modified_at)
        restored_at = None if message.restored_at is None else parse_instant(message.restored_at)
        if modified_at is None or (message.restored_at is not None and restored_at is None):
            raise protocol.ProtocolError(
                protocol.CLOSE_MALFORMED,
                "table_modified: modified_at and restored_at must be RFC 3339 instants",
            )
        log.warning(
            "%s reports its owned table edited by hand: %s (%s)",
            self.grant.hostname,
            visible(message.description[:200]),
            "restored" if restored_at is not None else "NOT restored",
        )
        await held_streams.db(sync.workload_table_modified)(
            workload_id=self.grant.workload_id,
            stream_id=self.stream_id,
            modified_at=modified_at,
            restored_at=restored_at,
            description=message.description,
        )

    async def renew(self) -> None:
        try:
            issued = await held_streams.db(credentials.credential_renew)(workload_id=self.grant.workload_id)
        except credentials.CredentialRevoked:
            raise streams.StreamRefused(
                protocol.CLOSE_CREDENTIAL_REVOKED, "renewal refused: the credential was revoked"
            ) from None
        except credentials.CredentialBeyondGrace as refused:
            await self.record_renewal_failure(refused.detail)
            raise streams.StreamRefused(protocol.CLOSE_FORBIDDEN, "renewal refused: re-enrol") from None
        except Exception as error:  # noqa: BLE001 - the control plane's own failure: the agent retries
            if not database_failed("renew credentials", error, log):
                log.exception("renewing the credential of %s failed", self.grant.hostname)
            await self.record_renewal_failure(f"the control plane failed to renew: {type(error).__name__}")
            raise streams.StreamRefused(protocol.CLOSE_TRY_AGAIN, "renewal failed: try again later") from None
        await self.send_message(
            protocol.CredentialIssued(
                credential=issued.text,
                expires_at=clock.rfc3339(issued.expires_at),
                renewal_due_at=clock.rfc3339(issued.renewal_due_at),
            )
        )
        log.info("renewed the credential of %s", self.grant.hostname)
        if self.grant.renew_only:
            # The renewed agent starts over with a normal stream under its new credential.
            await self.close(code=protocol.CLOSE_RECONNECT)

    async def record_renewal_failure(self, error: str) -> None:
        try:
            await held_streams.db(credentials.credential_renewal_failed)(
                workload_id=self.grant.workload_id, error=error
            )
        except Exception as error:  # noqa: BLE001 - the database may be what failed; the close must still happen
            if not database_failed("record failed renewals", error, log):
                log.exception("recording the failed renewal of %s failed too", self.grant.hostname)

    async def on_renewal_failed(self, message: protocol.RenewalFailed) -> None:
        await held_streams.db(credentials.credential_renewal_failed)(
            workload_id=self.grant.workload_id, error=message.error
        )

    # --- channel-layer events for this workload's group ---

    async def policy_updated(self, event):
        # Several notifications (a burst of writes, the catch-up sweep) may name one version.
        if not self.grant or self.grant.renew_only:
            return
        if self.unanswered is not None and time.monotonic() - self.unanswered[1] < SNAPSHOT_ANSWER_SECONDS:
            # Versions name documents, so a burst that returns to an earlier document repeats its
            # version: were a second snapshot sent now, an `applied` of the first could read as
            # convergence while the agent is still to apply the second. The latest goes with the answer.
            self.update_waiting = True
            return
        await self.send_snapshot(unless_version=self.sent_version)

    async def gateways_changed(self, event):
        if self.grant and not self.grant.renew_only:
            await self.send_message(protocol.Gateways(addresses=list(event["addresses"])))

    async def resend_snapshot(self, event):
        if self.grant:
            await self.send_message(protocol.Reconnect(reason="resend-snapshot"))
            await self.close(code=protocol.CLOSE_RECONNECT)

    async def credential_revoked(self, event):
        if self.grant:
            await self.refuse(protocol.CLOSE_CREDENTIAL_REVOKED, "the operator revoked the credential")

    async def stream_replaced(self, event):
        if event.get("stream_id") != self.stream_id:
            await self.refuse(protocol.CLOSE_REPLACED, "a newer stream of this workload took over")

    async def disconnect(self, code):
        await self.end_stream(code)

    async def stream_finished(self):
        # Also after a failure or a cancellation, which bring no disconnect: the fleet must not show a
        # stream that is gone as connected (nor a handshake timer fire on a finished stream).
        try:
            await self.end_stream("the application ended")
        except Exception:  # noqa: BLE001 - the database may be what failed; the reaper records it later
            log.exception("recording the end of a stream failed")

    def authentication_ended(self, *, completed: bool) -> None:
        if getattr(self, "admitted", False):
            self.admitted = False
            stream_admission().leave(self, completed=completed)

    async def end_stream(self, code) -> None:
        timer = getattr(self, "auth_timer", None)
        if timer:
            timer.cancel()
        self.authentication_ended(completed=False)
        grant = getattr(self, "grant", None)
        if grant is not None and held_streams.open_streams.pop(self.channel_name, None):
            try:
                await held_streams.db(sync.workload_stream_ended)(
                    workload_id=grant.workload_id,
                    stream_id=self.stream_id,
                    last_heartbeat=self.last_heartbeat,
                )
            except Exception as error:
                if not database_failed("record ended streams", error, log):
                    raise
                # Left recorded as open: the next stream of the workload, or the reaper of silent
                # streams, ends it.
            if not getattr(self, "database_away", False):  # a line per stream would flood an outage
                log.info("stream of %s ended (%s)", grant.hostname, code)

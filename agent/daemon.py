"""The agent daemon: one sync stream to the gateway, kept open for as long as the agent runs.

Fail static: whatever happens to the stream, the table in the kernel stays as it is; only a
snapshot changes it. The agent never restores a table someone deleted (that is the local kill
switch); it reports `absent`, and the next snapshot brings the table back.

Tamper evident: a change another process makes inside the table (a rule, chain, set or element
added, removed or replaced) is put right at once, by applying the last applied document again in one
atomic replace, and reported (`table_modified`). The agent's own replaces are told apart by what the
kernel announces: a transaction that deletes and re-creates the table while the agent applies.

Each event is logged as one line (eventlog.py; the full list is in agent/README.md):

    starting / stream connecting / stream connected / stream closed / stream error / protocol error
    backoff / applied / already applied / apply failed / table absent / table present / table checked
    table modified / table restored / restore failed
    reconnect requested / renewal requested / credential renewed / renewal failed / renewal unanswered
    state reloaded / stopping / stopped
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import ssl
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from agent import __version__, gateway_sets, outbound_observe
from agent import protocol as p
from agent.backoff import BACKOFF_CAP, BUSY_CAP, retry_delay
from agent.bundle import BundleError, gateways_check
from agent.credential import (
    CredentialError,
    credential_verify,
    format_instant,
    parse_instant,
    public_key_encode,
)
from agent.errors import AgentError, EnrolmentNeeded
from agent.eventlog import EventLog
from agent.gateways import CONNECT_SECONDS, Candidate, candidates, needs_resolving, rotated, silence_bounded
from agent.state import Identity, StateDir
from agent.status import DaemonStatus
from agent.tablediff import CHANGED, Changes, describe
from agent.tablewatch import ABSENT, PRESENT, UNKNOWN, TableWatcher, Transaction
from agent.tls import pinned_context
from agent.worker import DataplaneWorker

if TYPE_CHECKING:
    from agent.flowreporter import FlowReporter
    from agent.metrics import MetricsTextfile

# Straight to the gateway, as enrolment does: websockets >= 15 would otherwise follow HTTPS_PROXY
# (older versions, still allowed by the agent's dependencies, have no proxy support at all).
_DIRECT: dict[str, Any] = {"proxy": None} if "proxy" in inspect.signature(connect.__init__).parameters else {}
HANDSHAKE_SECONDS = 10  # for hello and welcome, as the gateway allows 10 s for auth
STABLE_SECONDS = 10.0  # a stream that lasted this long resets the backoff
RENEW_RETRY_SECONDS = 300.0
MAX_ERROR_CHARS = 16_000
# A hand edit is often several transactions (`nft -f` of a few lines, a script): wait this long after
# the first before restoring, so that one replace puts them all right and one report names them all.
RESTORE_SETTLE_SECONDS = 0.05


def _now() -> str:
    return format_instant(datetime.now(UTC))


def _instant_text(seconds: float) -> str:
    return format_instant(datetime.fromtimestamp(seconds, UTC))


def _instant(text: str | None) -> datetime | None:
    try:
        return parse_instant(text)
    except CredentialError:
        return None


class CredentialBeyondGrace(EnrolmentNeeded):
    """The gateway closed with 4403: only a new enrolment helps."""


class CredentialRevoked(EnrolmentNeeded):
    """The gateway closed with 4410: the operator revoked the credential; retrying cannot help, only a
    re-enrolment with a provisioning token minted for this workload."""


class HandshakeTimedOut(TimeoutError):
    """The gateway accepted the TCP connection but did not finish the TLS handshake and the websocket
    upgrade within the open timeout: up and busy (a failover's survivor queues the connections it
    cannot take yet in its listen queue), so the busy backoff applies, not a lost host's."""


class ConnectTimedOut(TimeoutError):
    """The gateway's TCP connection did not complete within CONNECT_SECONDS. A listener whose accept
    queue is full drops new connections' SYNs, and a failover's survivor fills its queue by design
    (at its bound on unfinished handshakes it stops accepting); an agent cannot tell that from a host
    that is gone. The busy backoff applies: against a gone host it costs a SYN every few seconds,
    while the longer one left the last agents of a 10,000-agent failover waiting up to a minute in
    front of a survivor with room (the last 1 % took 40 s of 118)."""


@dataclass(frozen=True)
class Outcome:
    immediate: bool = False  # reconnect at once, no backoff
    stable: bool = False  # the stream was up long enough to reset the backoff
    stopped: bool = False
    retry_after: float | None = None  # the gateway refused the upgrade with 503 or 429: wait this long
    busy: bool = False  # a gateway took the connection, then reset it or did not finish the handshake


class Agent:
    def __init__(
        self,
        state: StateDir,
        dataplane: DataplaneWorker,
        *,
        context: ssl.SSLContext | None = None,
        heartbeat_seconds: float = 15.0,
        watcher: TableWatcher | None = None,
        log: EventLog | None = None,
        compression: str | None = "deflate",
        flows: Callable[[Agent], FlowReporter] | None = None,
        metrics: MetricsTextfile | None = None,
        open_seconds: float = HANDSHAKE_SECONDS,
    ) -> None:
        self.state = state
        self.dataplane = dataplane
        self.heartbeat_seconds = heartbeat_seconds
        # For TLS and the websocket upgrade. A simulator holding thousands of agents on a share of one
        # core may need longer than a real agent on its own host: its handshakes wait for its own loop.
        self.open_seconds = open_seconds
        self.watcher = watcher
        self.log = log or EventLog()
        self.compression = compression
        self.process_start_id = uuid.uuid4().hex
        self.started = time.monotonic()
        self.applied_version: str | None = None
        self.apply_failures = 0
        self.denied_connections_ended = 0  # open connections a deny rule ended (agent/deny.py)
        self.force_apply = True  # the first snapshot of a process, and the one after a resend, always apply
        self.owned_table = UNKNOWN
        self._table_verdicts = 0  # how many verdicts on the table so far: a check outrun by one is stale
        self.renewal_due_at: datetime | None = None
        # The control plane's clock minus this host's, from the last Hello: credential times are the
        # control plane's, and a host clock days ahead would otherwise renew in a loop (due, renewed,
        # still due by its clock) and hold its flow reports back as if the credential had expired.
        self.server_offset = timedelta(0)
        self._context = context  # simulated agents share one
        self.gateways: list[str] = []
        self.connected_gateway: str | None = None  # the gateway of the open stream (its label)
        self._lost: Candidate | None = None  # the gateway whose stream ended last: tried last
        self._identity_stamp: int | None = None
        self.identity: Identity | None = None
        self._gateway_endpoints_seen: list[gateway_sets.Endpoint] = []
        self._load()
        self._ws: ClientConnection | None = None
        self._renew_only = False
        self._stop = asyncio.Event()  # events bind to a loop only when first awaited
        self._renewed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._applying = False
        self._deferred_verdict: str | None = None
        # Hand edits of the table: what the last applied document was (to put back), whether the kill
        # switch was used since (then nothing is put back until a snapshot), the edits not yet put
        # right, and the last episode, reported until the gateway has it.
        self.applied_document: str | None = None  # as applied: the gateway sets filled
        self._applied_base: str | None = None  # the same before the gateway sets were filled
        self._killed = False
        self._apply_lock = asyncio.Lock()
        self._drift: Changes | None = None
        self._drift_since: float | None = None  # when the first edit not yet put right was seen
        self.table_modifications = 0
        self.last_modification: p.TableModified | None = None
        self._modification_unsent = False
        self.status = DaemonStatus(
            state,
            workload_id=self.identity.workload_id,
            process_start_id=self.process_start_id,
            expires_at=self.expires_at,
            log=self.log,
        )
        self.renewal_due_at = _instant(self.status.renewal_due_at)
        self.metrics = metrics
        if metrics is not None:
            self.status.on_change = metrics.changed
        # Flow evidence runs beside the stream, not inside it: reports still go while the stream is down.
        self.flows = flows(self) if flows is not None else None

    # --- identity and credential ---

    def server_now(self) -> datetime:
        """Now by the control plane's clock, as the last Hello gave it."""
        return datetime.now(UTC) + self.server_offset

    def _load(self) -> None:
        """Read the enrolment; again before a reconnect after a re-enrolment."""
        enrolment = self.state.load_enrolment()
        pem = enrolment.identity.certificate_pem
        if self._context is None or (self.identity and self.identity.certificate_pem != pem):
            self._context = pinned_context(pem)
        self.identity, self.key, self.credential = enrolment.identity, enrolment.key, enrolment.credential
        self.gateways = self.state.load_gateways(enrolment.identity)
        self.expires_at = enrolment.expires_at
        self._identity_stamp = self.state.identity_stamp()

    def _reload_if_reenrolled(self) -> None:
        if self.state.identity_stamp() in (None, self._identity_stamp):
            return
        try:
            self._load()
        except AgentError as error:
            self.log("state reload failed", error=error.message)
            return
        self.status.workload(self.identity.workload_id)
        self.log("state reloaded", workload=self.identity.workload_id)

    def _credential_times(self, expires_at: str, renewal_due_at: str, state: str | None = None) -> None:
        self.expires_at = expires_at
        self.renewal_due_at = _instant(renewal_due_at)
        self.status.credential(expires_at, renewal_due_at, state)

    # --- the owned table ---

    @property
    def owned_table_reported(self) -> str:
        """The table's state as the control plane is told it: `absent` means enforcement removed, so a
        table not yet written by this process (a fresh enrolment, a host just rebooted) is `unknown`
        until the first apply, and the stored state stays as it was rather than raising a removal."""
        if self.owned_table == ABSENT and self.applied_version is None:
            return UNKNOWN
        return self.owned_table

    def _table_seen(self, state: str, *, initial: bool = False) -> None:
        self._table_verdicts += 1
        if state == ABSENT:
            self._killed, self._drift = True, None  # the kill switch: nothing is put back
        if state == self.owned_table:
            return
        self.owned_table = state
        self.status.table(state)
        if initial or state == UNKNOWN:
            self.log("table checked", state=state)
            return
        self.log(f"table {state}")
        if self._ws is not None and not self._renew_only and self.owned_table_reported != UNKNOWN:
            self._spawn(self._send(self._ws, p.TableState(state=state)))

    def table_event(self, verdict: str) -> None:
        """What the table watcher saw: `present`, `absent`, or `unknown` (notifications lost)."""
        if self._applying:  # our own apply: report after its `applied`, in a stable order
            self._deferred_verdict = verdict
        elif verdict == UNKNOWN:  # notifications were lost: ask the kernel
            self._spawn(self._check_table())
        else:
            self._table_seen(verdict)

    def table_transaction(self, transaction: Transaction) -> None:
        """One committed transaction that touched the table, as the watcher read it."""
        if transaction.state == UNKNOWN:
            self.table_event(UNKNOWN)
            return
        if transaction.replaced and self._applying:
            self.table_event(PRESENT)  # our own replace
            return
        if transaction.state == ABSENT:
            self.table_event(ABSENT)
            return
        changes = transaction.changes
        if transaction.replaced:  # the whole table replaced by another process
            changes = Changes()
            changes.add("table", "", "replaced")
        elif transaction.created and self.owned_table == PRESENT:  # its flags changed (`dormant`)
            changes = Changes()
            changes.add("table", "", CHANGED)
        if transaction.state == PRESENT and self.owned_table != PRESENT:
            self.table_event(PRESENT)  # re-created by hand after the kill switch: reported, left alone
            return
        if changes:
            self._drifted(changes)

    def _drifted(self, changes: Changes) -> None:
        if self.applied_document is None or self._killed:
            why = "the table was deleted (kill switch)" if self._killed else "nothing applied yet"
            self.log("table modified", difference=describe(changes), restored=f"no: {why}")
            return
        if self._drift is None:
            self._drift, self._drift_since = Changes(), time.time()
            self._spawn(self._restore())
        self._drift.update(changes)

    async def _restore(self) -> None:
        await asyncio.sleep(RESTORE_SETTLE_SECONDS)
        async with self._apply_lock:
            changes, since = self._drift, self._drift_since
            self._drift = None
            document = self.applied_document
            if changes is None or since is None or document is None or self._killed:
                return  # the table was deleted meanwhile (kill switch), or a snapshot replaced it
            restored_at: float | None = None
            self._applying, self._deferred_verdict = True, None
            try:
                await self.dataplane.apply(document)
                restored_at = time.time()
            except Exception as error:  # noqa: BLE001 - report the edit even if it could not be undone
                text = getattr(error, "message", None) or str(error) or type(error).__name__
                self.log("restore failed", error=text[:MAX_ERROR_CHARS])
                self.status.error(f"restoring the table after a hand edit failed: {text[:MAX_ERROR_CHARS]}")
            finally:
                self._end_apply()
        description = describe(changes)
        self.table_modifications += 1
        message = p.TableModified(
            modified_at=_instant_text(since),
            restored_at=None if restored_at is None else _instant_text(restored_at),
            description=description,
        )
        self.last_modification = message
        self.status.table_modified(message.modified_at, message.restored_at, description)
        self.log(
            "table restored" if restored_at is not None else "table modified",
            difference=description,
            modified_at=message.modified_at,
        )
        if self.flows is not None and restored_at is not None:
            self.flows.table_modified(since, restored_at)
        self._modification_unsent = True
        if self._ws is not None and not self._renew_only:
            self._spawn(self._send_modification(self._ws))

    async def _send_modification(self, ws: ClientConnection) -> None:
        message = self.last_modification
        if message is None or not self._modification_unsent:
            return
        try:
            await ws.send(message.encode())
        except ConnectionClosed:
            return  # sent again on the next stream
        if message is self.last_modification:
            self._modification_unsent = False

    def _end_apply(self) -> None:
        """After one of our replaces: what the kernel announced of it is already queued; read it now,
        while it still counts as ours."""
        if self.watcher is not None and self.watcher.sock is not None:
            for transaction in self.watcher.drain():
                self.table_transaction(transaction)
        self._applying = False
        if self._deferred_verdict is not None:
            verdict, self._deferred_verdict = self._deferred_verdict, None
            self.table_event(verdict)

    async def _check_table(self, *, initial: bool = False) -> None:
        verdicts = self._table_verdicts
        try:
            present = await self.dataplane.table_present()
        except Exception as error:  # noqa: BLE001 - a failed check must not stop the agent
            self.log("table check failed", error=getattr(error, "message", None) or str(error))
            self._table_seen(UNKNOWN)
            return
        if self._table_verdicts != verdicts:
            # The watcher saw a change while the kernel was asked (a delete just after the listing
            # began): its verdict is newer, and this answer would put `present` back for a heartbeat.
            return
        self._table_seen(PRESENT if present else ABSENT, initial=initial)

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- sending ---

    async def _send(self, ws: ClientConnection, message: p.Message) -> None:
        try:
            await ws.send(message.encode())
        except ConnectionClosed:
            pass  # the receive loop sees the close and decides what to do

    # --- the main loop ---

    async def run(self) -> None:
        """Until stop() (returns) or a close code that needs the operator (CredentialBeyondGrace,
        CredentialRevoked)."""
        self.log(
            "starting",
            workload=self.identity.workload_id,
            gateways=",".join(self.gateways),
            version=__version__,
        )
        if self.watcher is not None:
            self.watcher.attach(asyncio.get_running_loop(), self.table_transaction)
        await self._check_table(initial=True)
        flow_task = asyncio.ensure_future(self.flows.run(self._stop)) if self.flows is not None else None
        metrics_task = asyncio.ensure_future(self.metrics.run(self)) if self.metrics is not None else None
        attempt = 0
        try:
            while not self._stop.is_set():
                outcome = await self._session_or_stop()
                if outcome.stopped or self._stop.is_set():
                    break
                if outcome.immediate:
                    attempt = 0
                    continue
                if outcome.stable:
                    attempt = 0
                cap = BUSY_CAP if outcome.busy else BACKOFF_CAP
                delay = retry_delay(attempt, outcome.retry_after, spread=False, cap=cap)
                attempt += 1
                self.log("backoff", seconds=f"{delay:.2f}", attempt=attempt)
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                except TimeoutError:
                    pass
        finally:
            if self.watcher is not None:
                self.watcher.close()
            for task in list(self._tasks):
                task.cancel()
            if flow_task is not None:
                self._stop.set()
                await flow_task  # closes the open window and keeps it in the buffer
            self.status.stream("disconnected")
            if self.metrics is not None and metrics_task is not None:
                self.metrics.stop()
                # Its last write done, so that the final one is the last; whatever ended it.
                await asyncio.gather(metrics_task, return_exceptions=True)
                self.metrics.final(self)
            self.log("stopped")

    def stop(self, reason: str = "signal") -> None:
        if not self._stop.is_set():
            self.log("stopping", reason=reason)
            self._stop.set()

    async def _session_or_stop(self) -> Outcome:
        session = asyncio.ensure_future(self._session())
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({session, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not session.done() and self._ws is None:
                session.cancel()  # still connecting: nothing to close cleanly
            # A connected session sees the stop itself and closes with 1000.
            return await session
        except asyncio.CancelledError:
            if self._stop.is_set():
                return Outcome(stopped=True)
            raise
        finally:
            stopper.cancel()

    async def _session(self) -> Outcome:
        self._reload_if_reenrolled()
        self.status.stream("connecting")
        began = None
        outcome = Outcome()
        busy = False
        if needs_resolving(self.gateways):
            found = await asyncio.get_running_loop().run_in_executor(None, candidates, self.gateways)
        else:  # thousands of simulated agents reconnecting at once need no thread each
            found = candidates(self.gateways)
        # Having lost a gateway, the next one first: the lost one is most likely still gone.
        for candidate in rotated(found, self._lost):
            try:
                ws = await self._open(candidate)
            except EnrolmentNeeded:
                raise
            except Exception as error:  # noqa: BLE001 - whatever failed, the next gateway is tried
                outcome = self._open_failed(candidate, error)
                busy = busy or outcome.busy
                continue
            self._lost = None
            try:
                async with ws:
                    began = await self._authenticate(ws, candidate)
                    outcome = await self._converse(ws, began)
                    if not outcome.immediate:
                        self._lost = candidate
                    return outcome
            except EnrolmentNeeded:
                raise
            except ConnectionClosed as closed:
                code, reason = (
                    (closed.rcvd.code, closed.rcvd.reason) if closed.rcvd else (1006, "connection lost")
                )
                self._lost = candidate
                return self._closed(code, reason, began)
            except p.ProtocolError as error:
                self.log("protocol error", code=error.code, error=error.reason)
                self.status.error(f"protocol error from the gateway: {error.reason}")
            except (OSError, TimeoutError, WebSocketException) as error:
                self._connect_failed(getattr(error, "strerror", None) or str(error) or type(error).__name__)
            except Exception as error:  # noqa: BLE001 - a firewall agent logs, backs off and carries on
                self._connect_failed(f"unexpected {type(error).__name__}: {error}")
            finally:
                self._ws = None
                self._renew_only = False
                self.connected_gateway = None
                self.status.stream("disconnected")
            self._lost = candidate
            return Outcome(stable=self._was_stable(began))
        # No gateway answered: back off (as long as the last one asked, if it did) and try them all
        # again, the lost one still last: starting with it each time cost a gone host's CONNECT_SECONDS
        # before every try of the others.
        self.status.stream("disconnected")
        return replace(outcome, busy=busy)

    async def _open(self, candidate: Candidate) -> ClientConnection:
        """The websocket to one gateway; the TCP connection given CONNECT_SECONDS, so that a gateway
        whose host is gone does not hold up the next one for the whole handshake time."""
        uri = f"wss://{candidate.address}{p.STREAM_PATH}"
        self.log(
            "stream connecting",
            url=uri,
            address=candidate.host if candidate.label != candidate.address else None,
        )
        family = socket.AF_INET6 if ":" in candidate.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        silence_bounded(sock)
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_connect(sock, (candidate.host, candidate.port)),
                CONNECT_SECONDS,
            )
        except TimeoutError:
            sock.close()
            raise ConnectTimedOut from None
        except BaseException:
            sock.close()
            raise
        # From here the socket is the transport's, which closes it when the handshake fails (a TLS
        # transport only after its shutdown). Closing it here as well freed its descriptor while the
        # transport still held it: the next socket given that number failed with "File descriptor N
        # is used by transport" until the old transport ended, which under 10,000 simulated agents
        # timing out kept a third of the fleet from ever connecting.
        try:
            return await connect(
                uri,
                sock=sock,
                ssl=self._context,
                max_size=p.MAX_MESSAGE_BYTES,
                open_timeout=self.open_seconds,
                close_timeout=5,
                compression=self.compression,
                **_DIRECT,
                user_agent_header=f"palisade-agent/{__version__}",
            )
        except TimeoutError:
            raise HandshakeTimedOut from None

    def _open_failed(self, candidate: Candidate, error: Exception) -> Outcome:
        if isinstance(error, ssl.SSLCertVerificationError):
            message = f"the gateway no longer presents the pinned certificate ({error.verify_message})"
        elif isinstance(error, InvalidStatus):
            status = error.response.status_code
            self._connect_failed(f"the gateway {candidate.label} refused the stream with HTTP {status}")
            return Outcome(retry_after=p.retry_after(status, error.response.headers.get("Retry-After")))
        elif isinstance(error, HandshakeTimedOut):
            # It took the connection: up, with more handshakes queued than it finished in time.
            self._connect_failed(f"the gateway {candidate.label}: TLS handshake or upgrade timed out (busy)")
            return Outcome(busy=True)
        elif isinstance(error, ConnectTimedOut):
            self._connect_failed(
                f"the gateway {candidate.label}: TCP connection timed out (busy, or its host is gone)"
            )
            return Outcome(busy=True)
        elif isinstance(error, TimeoutError):
            message = "timed out"
        elif isinstance(error, ConnectionResetError):  # connected, then reset: the gateway is up, at a bound
            self._connect_failed(f"the gateway {candidate.label}: connection reset before the stream (busy)")
            return Outcome(busy=True)
        elif isinstance(error, OSError | WebSocketException):
            message = getattr(error, "strerror", None) or str(error) or type(error).__name__
        else:
            message = f"unexpected {type(error).__name__}: {error}"
        self._connect_failed(f"the gateway {candidate.label}: {message}")
        return Outcome()

    def _connect_failed(self, message: str) -> None:
        self.log("stream error", error=message)
        self.status.error(message)

    def _was_stable(self, began: float | None) -> bool:
        return began is not None and time.monotonic() - began >= STABLE_SECONDS

    def _closed(self, code: int, reason: str, began: float | None) -> Outcome:
        self.log("stream closed", code=code, reason=reason or None)
        if code == p.CLOSE_FORBIDDEN:
            message = (
                f"the control plane refused the credential of workload {self.identity.workload_id}: "
                f"it expired beyond its grace ({reason or 'close code 4403'}); re-enrol this host with "
                "'palisade-agent enrol --reenrol --bundle ...' and a provisioning token minted for this workload"
            )
            self.status.error(message)
            raise CredentialBeyondGrace(message)
        if code == p.CLOSE_CREDENTIAL_REVOKED:
            workload = self.identity.workload_id
            message = (
                f"the operator revoked the credential of workload {workload} (close code 4410); this agent "
                "stops. To bring the host back, the operator mints a provisioning token for this workload "
                f"('manage.py provisioning-token mint --workload-id {workload} ...') and this host runs "
                "'palisade-agent enrol --reenrol --bundle ...' with it"
            )
            self.status.error(message)
            raise CredentialRevoked(message)
        if code == p.CLOSE_RECONNECT:
            self.force_apply = True
            return Outcome(immediate=True)
        if code == p.CLOSE_UNAUTHENTICATED:
            self.status.error(f"the gateway refused this agent's proof or credential (4401 {reason})".strip())
        elif code == p.CLOSE_TRY_AGAIN:
            self.status.error(f"the control plane failed on its side ({reason or code}); retrying")
        elif code == p.CLOSE_SHUTDOWN:
            self.status.error(f"the control plane is unavailable ({reason or code}); retrying")
            wait = p.close_reason_retry_after(reason)
            if wait is not None:  # its database is away: come back when told, not at once
                return Outcome(retry_after=wait)
        elif code not in (1000, 1001):
            self.status.error(f"the stream closed with code {code} {reason}".strip())
        return Outcome(stable=self._was_stable(began))

    async def _expect(self, ws: ClientConnection, kind: type[p.Message]) -> p.Message:
        try:
            text = await asyncio.wait_for(ws.recv(), HANDSHAKE_SECONDS)
        except TimeoutError:
            error = p.ProtocolError(p.CLOSE_HANDSHAKE_TIMEOUT, f"no {kind.type} within {HANDSHAKE_SECONDS} s")
            await ws.close(error.code, error.reason)
            raise error from None
        message = await self._decode(ws, text)
        if not isinstance(message, kind):
            await self._refuse(
                ws, p.ProtocolError(p.CLOSE_UNEXPECTED, f"expected {kind.type}, got {message.type}")
            )
        return message

    async def _decode(self, ws: ClientConnection, text: str | bytes) -> p.Message:
        try:
            return p.decode(text, sender="gateway")
        except p.ProtocolError as error:
            await self._refuse(ws, error)
            raise

    async def _refuse(self, ws: ClientConnection, error: p.ProtocolError) -> None:
        """Close with the protocol's code for what the gateway got wrong, then fail the session."""
        await ws.close(error.code, error.reason)
        raise error

    async def _authenticate(self, ws: ClientConnection, candidate: Candidate) -> float:
        hello = await self._expect(ws, p.Hello)
        server_time = _instant(hello.server_time)
        if server_time is not None:
            self.server_offset = server_time - datetime.now(UTC)
        try:
            nonce = p.b64decode(hello.nonce, what="hello nonce", length=32)
        except p.ProtocolError as error:
            await ws.close(error.code, error.reason)
            raise
        proof = p.sign_proof(
            self.key,
            nonce=nonce,  # the 32 raw bytes, not their base64 text
            workload_id=self.identity.workload_id,
            gateway_fingerprint=self.identity.fingerprint,
        )
        auth = p.Auth(
            workload_id=self.identity.workload_id,
            credential=self.credential,
            proof=proof,
            agent_version=__version__,
            process_start_id=self.process_start_id,
            uptime_seconds=round(time.monotonic() - self.started, 3),
            owned_table=self.owned_table_reported,
            gateway=candidate.address,
        )
        await ws.send(auth.encode())
        welcome = await self._expect(ws, p.Welcome)
        self._ws = ws
        self._renew_only = welcome.renew_only
        self._credential_times(welcome.expires_at, welcome.renewal_due_at, welcome.credential_state)
        self.connected_gateway = candidate.label
        if not self._renew_only and self._modification_unsent:
            self._spawn(self._send_modification(ws))  # an edit put right while the stream was down
        self.status.stream("connected", gateway=candidate.label)
        self.log(
            "stream connected",
            workload=welcome.workload_id,
            gateway=candidate.label,
            credential=welcome.credential_state,
            renew_only="yes" if welcome.renew_only else None,
        )
        return time.monotonic()

    async def _converse(self, ws: ClientConnection, began: float) -> Outcome:
        jobs = [self._receive(ws), self._stop.wait()]
        if self._renew_only:
            jobs.append(self._renew_at_once(ws))
        else:
            jobs += [self._heartbeats(ws), self._renewals(ws)]
        tasks = [asyncio.ensure_future(job) for job in jobs]
        stopper = tasks[1]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if stopper in done:
            await ws.close(1000, "agent stopping")
            return Outcome(stopped=True)
        for task in done:
            task.result()  # raises what ended the session
        outcome = tasks[0].result() if tasks[0] in done else Outcome()
        if outcome is None:
            return self._closed(ws.close_code or 1006, ws.close_reason or "", began)
        return outcome

    async def _receive(self, ws: ClientConnection) -> Outcome | None:
        async for text in ws:  # ends quietly on a 1000/1001 close, raises ConnectionClosed on others
            message = await self._decode(ws, text)
            if self._renew_only and not isinstance(message, p.CredentialIssued):
                await self._refuse(
                    ws, p.ProtocolError(p.CLOSE_UNEXPECTED, f"{message.type} during renew_only")
                )
            if isinstance(message, p.Snapshot):
                await self._on_snapshot(ws, message)
            elif isinstance(message, p.CredentialIssued):
                renewed = await self._on_credential(ws, message)
                if self._renew_only:
                    # The stream was only good for renewing: a new one, with the new credential,
                    # begins with a snapshot.
                    await ws.close(1000, "renewed")
                    return Outcome(immediate=renewed)
            elif isinstance(message, p.Gateways):
                await self._on_gateways(ws, message)
            elif isinstance(message, p.Reconnect):
                self.log("reconnect requested", reason=message.reason)
                self.force_apply = True
                await ws.close(1000, "reconnecting")
                return Outcome(immediate=True)
            else:
                await self._refuse(ws, p.ProtocolError(p.CLOSE_UNEXPECTED, f"{message.type} after welcome"))
        return None

    # --- the list of gateways ---

    async def _on_gateways(self, ws: ClientConnection, message: p.Gateways) -> None:
        """Keep the control plane's list for the next connection; a list that is no list ends the
        stream as malformed, and the one kept stays."""
        try:
            gateways = gateways_check(message.addresses, what="the gateways the gateway sent")
        except BundleError as error:
            await self._refuse(ws, p.ProtocolError(p.CLOSE_MALFORMED, str(error)))
            return
        if gateways == self.gateways:
            return
        try:
            self.state.write_gateways(gateways, updated_at=_now())
        except AgentError as error:
            self.log("gateways not kept", error=error.message)
            return
        self.gateways = gateways
        self.log("gateways changed", gateways=",".join(gateways))
        await self._refill_gateway_sets(ws)

    async def _refill_gateway_sets(self, ws: ClientConnection) -> None:
        """The table's gateway sets as the changed list gives them, at once rather than at the next
        policy version: the last applied document again, its sets filled anew, in one replace. Not after
        the kill switch (the table stays gone until a snapshot) and not for a document without the sets."""
        async with self._apply_lock:
            base = self._applied_base
            if base is None or self._killed or gateway_sets.GATEWAY_SETS[4] not in base:
                return
            document = gateway_sets.with_gateways(base, await self._gateway_endpoints(ws))
            if document == self.applied_document:
                return
            self._applying, self._deferred_verdict = True, None
            try:
                await self.dataplane.apply(document)
            except Exception as error:  # noqa: BLE001 - the previous table stands; say why
                text = (getattr(error, "message", None) or str(error) or type(error).__name__)[
                    :MAX_ERROR_CHARS
                ]
                self.log("gateway sets not applied", version=self.applied_version, error=text)
                self.status.error(f"applying the changed gateways to the table failed: {text}")
                return
            finally:
                self._end_apply()
            self.applied_document = document
        self.log("gateway sets applied", version=self.applied_version)

    # --- snapshots ---

    async def _on_snapshot(self, ws: ClientConnection, snapshot: p.Snapshot) -> None:
        if not self.force_apply and snapshot.version == self.applied_version and await self._present_now():
            self.log("already applied", version=snapshot.version)
            await self._send(ws, p.Applied(version=snapshot.version))
            return
        async with self._apply_lock:
            self._applying, self._deferred_verdict = True, None
            try:
                await self._apply(ws, snapshot)
            finally:
                self._end_apply()

    async def _gateway_endpoints(self, ws: ClientConnection) -> list[gateway_sets.Endpoint]:
        """Where this agent reaches the control plane: every listed gateway's addresses now (any of them
        may be the next it connects to), and the stream's peer; the last resolved ones when no lookup
        succeeds (agent/gateway_sets.py)."""
        listed = list(self.gateways)
        if needs_resolving(listed):
            resolved = await asyncio.get_running_loop().run_in_executor(None, gateway_sets.resolve, listed)
        else:  # addresses only: no lookup blocks, and thousands of simulated agents need no thread each
            resolved = gateway_sets.resolve(listed)
        if resolved:
            self._gateway_endpoints_seen = resolved
        found = list(resolved or self._gateway_endpoints_seen)
        remote = getattr(ws, "remote_address", None)
        if remote:
            found.append((str(remote[0]), int(remote[1])))
        return found

    async def _apply(self, ws: ClientConnection, snapshot: p.Snapshot) -> None:
        try:
            # Outbound visibility: the document has no output chain, the agent adds its observe-only one.
            base = document = outbound_observe.with_output_observed(snapshot.document)
            if gateway_sets.GATEWAY_SETS[4] in document:
                document = gateway_sets.with_gateways(document, await self._gateway_endpoints(ws))
            await self.dataplane.apply(document)
        except Exception as error:  # noqa: BLE001 - whatever refused the document, report it
            text = (getattr(error, "message", None) or str(error) or type(error).__name__)[:MAX_ERROR_CHARS]
            self.apply_failures += 1
            self.log("apply failed", version=snapshot.version, error=text)
            self.status.error(f"applying version {snapshot.version} failed: {text}")
            await self._send(ws, p.Failed(version=snapshot.version, error=text))
            return
        self.applied_version = snapshot.version
        # What a hand edit is undone with: the table as applied, gateways and all.
        self.applied_document, self._applied_base = document, base
        self._killed = False  # a snapshot ends the kill switch
        self.force_apply = False
        self.status.applied(snapshot.version, snapshot.mode)
        self.log("applied", version=snapshot.version, mode=snapshot.mode)
        await self._send(ws, p.Applied(version=snapshot.version))
        self._table_seen(PRESENT)
        if snapshot.mode == "enforced":
            await self._end_denied(snapshot)

    async def _end_denied(self, snapshot: p.Snapshot) -> None:
        """A deny rule also ends the connections it refuses that are open now (agent/deny.py): only once
        the table is in place, so that the peer's next packet meets the rule."""
        try:
            ended = await self.dataplane.end_denied(snapshot.document)
        except Exception as error:  # noqa: BLE001 - the table stands; say what could not be ended
            self.log("ending denied connections failed", version=snapshot.version, error=str(error))
            return
        if ended:
            self.denied_connections_ended += ended
            self.log("ended denied connections", version=snapshot.version, connections=ended)

    async def _present_now(self) -> bool:
        try:
            return await self.dataplane.table_present()
        except Exception:  # noqa: BLE001 - unsure means apply again
            return False

    # --- heartbeats ---

    async def _heartbeats(self, ws: ClientConnection) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            await self._check_table()  # also catches a delete the watcher could not see
            await self._send(
                ws,
                p.Heartbeat(
                    process_start_id=self.process_start_id,
                    uptime_seconds=round(time.monotonic() - self.started, 3),
                    clock=_now(),
                    owned_table=self.owned_table_reported,
                    flow_backlog_since=self.flows.backlog_since() if self.flows is not None else None,
                ),
            )

    # --- credential renewal ---

    async def _request_renewal(self, ws: ClientConnection) -> None:
        self._renewed.clear()
        self.log("renewal requested", renewal_due_at=self.status.renewal_due_at)
        await self._send(ws, p.Renew())

    async def _renew_at_once(self, ws: ClientConnection) -> None:
        await self._request_renewal(ws)
        await asyncio.Event().wait()  # the receive loop ends this stream when the credential arrives

    async def _renewals(self, ws: ClientConnection) -> None:
        while True:
            due = self.renewal_due_at
            wait = (due - self.server_now()).total_seconds() if due else 3600.0
            if wait > 0:
                self._renewed.clear()
                try:  # wake early when a credential arrives unasked and moves the due time
                    await asyncio.wait_for(self._renewed.wait(), min(wait, 3600.0))
                except TimeoutError:
                    pass
                continue
            await self._request_renewal(ws)
            try:
                await asyncio.wait_for(self._renewed.wait(), RENEW_RETRY_SECONDS)
            except TimeoutError:
                self.log("renewal unanswered", seconds=RENEW_RETRY_SECONDS)

    async def _on_credential(self, ws: ClientConnection, issued: p.CredentialIssued) -> bool:
        try:
            payload = credential_verify(issued.credential, self.identity.signing_public_key)
            if payload["public_key"] != public_key_encode(self.key.public_key()):
                raise CredentialError("the new credential names another key")
            if payload["workload_id"] != self.identity.workload_id:
                raise CredentialError("the new credential names another workload")
            if _instant(issued.renewal_due_at) is None:
                raise CredentialError(f"renewal_due_at {issued.renewal_due_at!r} is not an RFC 3339 instant")
            self.state.write_credential(issued.credential)
        except (CredentialError, AgentError) as error:
            text = getattr(error, "message", None) or str(error)
            self.log("renewal failed", error=text)
            self.status.error(f"renewal failed: {text}")
            await self._send(ws, p.RenewalFailed(error=text[:2000]))
            return False
        self.credential = issued.credential
        self._credential_times(payload["expires_at"], issued.renewal_due_at, "renews")
        self._renewed.set()
        self.log("credential renewed", expires_at=payload["expires_at"], renewal_due_at=issued.renewal_due_at)
        return True

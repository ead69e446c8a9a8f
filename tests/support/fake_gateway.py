"""A stand-in for the gateway listener, for the agent's own tests (the real one lives in the control
plane; the lead's end-to-end tests use that).

It speaks agent/protocol.py exactly: `POST /agent/v1/enrol` over HTTPS and the sync stream over
wss, both on one TLS port with a certificate made by controlplane.tls (so pinning is exercised
against the same kind of certificate the real gateway generates). A front TLS server reads the
request head and either answers the enrolment itself or relays the connection to a plaintext
websockets server on loopback.

In-process (asyncio):

    gateway = FakeGateway(tmp_path); await gateway.start()
    bundle = gateway.bundle(gateway.add_token(uses=5))

As a process inside a network namespace (`python -m tests.support.fake_gateway DATA_DIR`): prints
`{"ready": ..., "bundle": ...}`, then one JSON line per event; reads one JSON command per line.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import ssl
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from agent import protocol as p
from agent.bundle import bundle_encode
from agent.credential import (
    CredentialError,
    credential_payload,
    credential_sign,
    credential_verify,
    format_instant,
    public_key_encode,
)
from controlplane.tls import ensure_certificate

PROBLEM = "application/problem+json"


class FakeGateway:
    def __init__(self, data_dir: str | Path, host: str = "127.0.0.1") -> None:
        self.host = host
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        cert = ensure_certificate(data_dir, "gateway", [])
        self.fingerprint = cert.fingerprint
        self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.tls.load_cert_chain(cert.cert_path, cert.key_path)
        self.signing_key = Ed25519PrivateKey.generate()
        self.signing_public_key = public_key_encode(self.signing_key.public_key())
        self.tokens: dict[str, int] = {}  # token -> uses left
        self.workloads: dict[str, dict[str, Any]] = {}  # id -> {public_key, hostname, addresses}
        self.snapshots: dict[str, p.Snapshot] = {}  # the latest snapshot of each workload
        self.streams: dict[str, ServerConnection] = {}
        self.renew_only: set[str] = set()  # workloads whose next stream is renew_only
        self.refuse: dict[str, tuple[int, str]] = {}  # workload -> close code after auth
        self.credential_seconds = 3600.0
        self.renewal_due_seconds = 2400.0  # negative: due at once
        self.welcome_renewal_due_seconds: float | None = None  # only what `welcome` says, if set
        self.clock_offset = timedelta(0)  # this gateway's clock minus the host's: Hello and that due time
        self.forge_renewals = False  # sign renewed credentials with a stranger's key
        self.enrolments_unavailable = (
            0  # answer this many enrolments 503 with Retry-After, as without a database
        )
        self.retry_after = "0"
        self.events: list[dict[str, Any]] = []
        self.front_connections = 0
        self.request_bytes_seen = 0
        self._changed = asyncio.Event()
        self._serial = 0
        self.enrol_requests: list[dict[str, Any]] = []
        self.serials: dict[str, int] = {}  # workload -> the serial of its latest credential
        self.port = 0
        self.echo = False  # print events as JSON lines (process mode)

    # --- set-up ---

    async def start(self) -> FakeGateway:
        self._inner = await serve(
            self._stream, "127.0.0.1", 0, max_size=p.MAX_MESSAGE_BYTES, compression=None
        )
        self._inner_port = self._inner.sockets[0].getsockname()[1]
        self._front = await asyncio.start_server(self._accept, self.host, 0, ssl=self.tls)
        self.port = self._front.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self._front.close()
        self._inner.close()
        await self._inner.wait_closed()

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def add_token(self, uses: int = 1) -> str:
        token = "pal_pt_" + secrets.token_urlsafe(24)
        self.tokens[token] = uses
        return token

    def bundle(self, token: str, fingerprint: str | None = None) -> str:
        return bundle_encode(gateway=self.address, fingerprint=fingerprint or self.fingerprint, token=token)

    # --- events, for tests to wait on ---

    def _record(self, kind: str, workload: str | None, **data: Any) -> None:
        event = {"kind": kind, "workload": workload, **data}
        self.events.append(event)
        if self.echo:
            print(json.dumps({k: v for k, v in event.items() if k != "message"}), flush=True)
        self._changed.set()

    async def wait_for(self, predicate, timeout: float = 15.0, start: int = 0) -> dict[str, Any]:
        """The first event from index `start` on that satisfies `predicate`."""
        deadline = asyncio.get_running_loop().time() + timeout
        seen = start
        while True:
            for event in self.events[seen:]:
                if predicate(event):
                    return event
            seen = len(self.events)
            self._changed.clear()
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise AssertionError(f"no matching event within {timeout} s; saw {self.summary(start)}")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass

    def summary(self, start: int = 0) -> list[str]:
        return [f"{e['kind']}:{e.get('type') or e.get('code') or ''}" for e in self.events[start:]]

    def messages(self, kind: str, workload: str | None = None) -> list[dict[str, Any]]:
        return [
            e["data"]
            for e in self.events
            if e["kind"] == "message"
            and e["type"] == kind
            and (workload is None or e["workload"] == workload)
        ]

    # --- operations a test drives ---

    async def push_snapshot(self, workload: str, version: str, document: str, mode: str = "enforced") -> None:
        snapshot = p.Snapshot(version=version, mode=mode, document=document, rule_index={})
        self.snapshots[workload] = snapshot
        stream = self.streams.get(workload)
        if stream is not None:
            await stream.send(snapshot.encode())

    async def resend(self, workload: str) -> None:
        stream = self.streams[workload]
        await stream.send(p.Reconnect(reason="resend-snapshot").encode())
        await stream.close(p.CLOSE_RECONNECT, "resend-snapshot")

    async def close_stream(self, workload: str, code: int, reason: str = "") -> None:
        await self.streams[workload].close(code, reason)

    # --- the front door: enrolment here, streams relayed ---

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.front_connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ssl.SSLError):
            writer.close()
            return
        self.request_bytes_seen += len(head)
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        if request_line.startswith(f"POST {p.ENROL_PATH} "):
            await self._enrol_http(head, reader, writer)
            return
        inner_reader, inner_writer = await asyncio.open_connection("127.0.0.1", self._inner_port)
        inner_writer.write(head)
        await asyncio.gather(_pipe(reader, inner_writer), _pipe(inner_reader, writer))

    async def _enrol_http(
        self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        length = 0
        for line in head.decode("latin-1").split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        body = await reader.readexactly(length)
        extra = ""
        if self.enrolments_unavailable > 0:
            self.enrolments_unavailable -= 1
            self._record("enrolment unavailable", None)
            status, content_type, answer = self._problem(
                503, "service-unavailable", "The control plane cannot reach its database."
            )
            extra = f"Retry-After: {self.retry_after}\r\n"
        else:
            status, content_type, answer = self.enrol(json.loads(body))
        data = json.dumps(answer).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(data)}\r\n"
            f"{extra}Connection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()
        writer.close()

    def _problem(self, status: int, name: str, detail: str) -> tuple[int, str, dict]:
        return (
            status,
            PROBLEM,
            {"type": f"urn:service:problem:{name}", "title": name, "status": status, "detail": detail},
        )

    def issue(self, workload: str, signer: Ed25519PrivateKey | None = None) -> p.CredentialIssued:
        self._serial += 1
        self.serials[workload] = self._serial
        now = datetime.now(UTC)
        payload = credential_payload(
            workload_id=workload,
            public_key=self.workloads[workload]["public_key"],
            serial=self._serial,
            issued_at=now,
            expires_at=now + timedelta(seconds=self.credential_seconds),
        )
        return p.CredentialIssued(
            credential=credential_sign(payload, signer or self.signing_key),
            expires_at=payload["expires_at"],
            renewal_due_at=format_instant(now + timedelta(seconds=self.renewal_due_seconds)),
        )

    def _key_proof_admits(self, request: dict[str, Any]) -> bool:
        """A re-enrolment signed with the workload's current key, as the real gateway checks it (less
        its clock and revocation rules)."""
        workload, proof = request.get("workload_id"), request.get("key_proof")
        if workload not in self.workloads or not isinstance(proof, dict):
            return False
        return proof.get("serial") == self.serials.get(workload) and p.verify_key_proof(
            self.workloads[workload]["public_key"],
            proof.get("signature", ""),
            workload_id=workload,
            serial=proof.get("serial"),
            public_key=request["public_key"],
            hostname=request["hostname"],
            addresses=request["addresses"],
            signed_at=proof.get("signed_at"),
            gateway_fingerprint=self.fingerprint,
        )

    def enrol(self, request: dict[str, Any]) -> tuple[int, str, dict]:
        self.enrol_requests.append(request)
        token = request.get("token")
        by_key = self._key_proof_admits(request)
        if not by_key and self.tokens.get(token, 0) < 1:
            return self._problem(
                401, "unauthenticated", "The provisioning token is unknown, revoked, expired or used up."
            )
        workload = request.get("workload_id")
        if workload is not None and workload not in self.workloads:
            return self._problem(404, "not-found", f"No workload {workload}.")
        if not by_key:
            self.tokens[token] -= 1
        workload = workload or str(uuid.uuid4())
        self.workloads[workload] = {
            "public_key": request["public_key"],
            "hostname": request["hostname"],
            "addresses": request["addresses"],
        }
        self._record("enrolled", workload, hostname=request["hostname"], addresses=request["addresses"])
        issued = self.issue(workload)
        response = p.EnrolResponse(
            workload_id=workload,
            credential=issued.credential,
            signing_public_key=self.signing_public_key,
            expires_at=issued.expires_at,
            renewal_due_at=issued.renewal_due_at,
        )
        return 201, "application/json", response.to_dict()

    # --- the stream ---

    async def _stream(self, ws: ServerConnection) -> None:
        workload = None
        try:
            workload = await self._authenticate(ws)
            if workload is None:
                return
            async for text in ws:
                try:
                    message = p.decode(text, sender="agent")
                except p.ProtocolError as error:
                    self._record("protocol-error", workload, code=error.code, reason=error.reason)
                    await ws.close(error.code, error.reason)
                    return
                self._record("message", workload, type=message.type, data=message.to_dict())
                if isinstance(message, p.Renew):
                    self.renew_only.discard(workload)
                    signer = Ed25519PrivateKey.generate() if self.forge_renewals else None
                    await ws.send(self.issue(workload, signer).encode())
        except ConnectionClosed:
            pass
        finally:
            if workload is not None and self.streams.get(workload) is ws:
                del self.streams[workload]
            self._record("closed", workload, code=ws.close_code, reason=ws.close_reason)

    async def _authenticate(self, ws: ServerConnection) -> str | None:
        nonce = secrets.token_bytes(32)
        await ws.send(
            p.Hello(
                nonce=p.b64encode(nonce), server_time=format_instant(datetime.now(UTC) + self.clock_offset)
            ).encode()
        )
        auth = p.decode(await ws.recv(), sender="agent")
        if not isinstance(auth, p.Auth) or auth.workload_id not in self.workloads:
            await ws.close(p.CLOSE_UNAUTHENTICATED, "unknown workload")
            return None
        workload = auth.workload_id
        public_key = self.workloads[workload]["public_key"]
        try:
            payload = credential_verify(auth.credential, self.signing_public_key)
        except CredentialError:
            payload = {}
        proof_ok = p.verify_proof(
            public_key, auth.proof, nonce=nonce, workload_id=workload, gateway_fingerprint=self.fingerprint
        )
        if payload.get("public_key") != public_key or payload.get("workload_id") != workload or not proof_ok:
            self._record("refused", workload, code=p.CLOSE_UNAUTHENTICATED)
            await ws.close(p.CLOSE_UNAUTHENTICATED, "bad proof or credential")
            return None
        self._record("auth", workload, data=auth.to_dict())
        if workload in self.refuse:
            code, reason = self.refuse[workload]
            await ws.close(code, reason)
            return None
        renew_only = workload in self.renew_only
        issued = self.issue(workload)  # only for its instants: the stored credential stays as it is
        renewal_due_at = issued.renewal_due_at
        if self.welcome_renewal_due_seconds is not None:
            due = datetime.now(UTC) + self.clock_offset + timedelta(seconds=self.welcome_renewal_due_seconds)
            renewal_due_at = format_instant(due)
        await ws.send(
            p.Welcome(
                workload_id=workload,
                credential_state="expired" if renew_only else "renews",
                expires_at=issued.expires_at,
                renewal_due_at=renewal_due_at,
                renew_only=renew_only,
            ).encode()
        )
        self.streams[workload] = ws
        self._record("connected", workload, renew_only=renew_only)
        if not renew_only and workload in self.snapshots:
            await ws.send(self.snapshots[workload].encode())
        return workload


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        try:
            writer.close()
        except (ConnectionError, RuntimeError):
            pass


# --- process mode, for agents running inside a network namespace ---


async def _serve_process(data_dir: str, host: str = "127.0.0.1") -> None:
    gateway = await FakeGateway(data_dir, host).start()
    gateway.echo = True
    token = gateway.add_token(uses=100)
    print(json.dumps({"ready": gateway.address, "bundle": gateway.bundle(token)}), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = json.loads(line)
        op = command.pop("op")
        if op == "snapshot":
            await gateway.push_snapshot(**command)
        elif op == "resend":
            await gateway.resend(command["workload"])
        elif op == "refuse":
            gateway.refuse[command["workload"]] = (command["code"], command.get("reason", ""))
        elif op == "close":
            await gateway.close_stream(command["workload"], command["code"], command.get("reason", ""))
        print(json.dumps({"kind": "done", "op": op}), flush=True)
    await gateway.close()


if __name__ == "__main__":
    asyncio.run(_serve_process(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1"))

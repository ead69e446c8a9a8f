"""One agent's sync stream to the real serve, on a thread of its own, spoken with agent/protocol.py and
an enrolled agent's real key and credential: it acknowledges every snapshot and sends a heartbeat every
`every` seconds whose `flow_backlog_since` changes each time, so that each heartbeat is a write on the
control plane's side (an unchanged one is written once a minute only). It records what it received and
how the stream ended, if it did.

    stream = SyncStream(StateDir(path).load_enrolment()).started()
    ...
    assert stream.closed is None and stream.snapshots
    stream.stop()
"""

from __future__ import annotations

import threading
import time
import uuid

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from agent import protocol as p
from agent.state import Enrolment
from agent.tls import pinned_context


class SyncStream(threading.Thread):
    def __init__(self, enrolment: Enrolment, *, every: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.enrolment, self.every = enrolment, every
        self.process = str(uuid.uuid4())
        self.snapshots: list[p.Snapshot] = []
        self.heartbeats = 0
        self.closed: tuple[int | None, str] | None = None  # (code, reason) once the server ended it
        self.error: str | None = None
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self._send_now: list[p.Message] = []
        self._lock = threading.Lock()

    def started(self, timeout: float = 30) -> SyncStream:
        self.start()
        if not self.ready.wait(timeout):
            raise AssertionError(f"the stream did not open: {self.error or self.closed}")
        return self

    def send(self, message: p.Message) -> None:
        """Send `message` from the stream's thread, before its next heartbeat."""
        with self._lock:
            self._send_now.append(message)

    def wait_for(self, what: str, done, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s (closed {self.closed}, {self.error})")
            time.sleep(0.1)

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)

    def run(self) -> None:
        identity = self.enrolment.identity
        started = time.monotonic()
        try:
            with connect(
                f"wss://{identity.gateway}{p.STREAM_PATH}",
                ssl=pinned_context(identity.certificate_pem),
                open_timeout=20,
            ) as ws:
                hello = p.decode(ws.recv(timeout=20), sender="gateway")
                proof = p.sign_proof(
                    self.enrolment.key,
                    nonce=p.b64decode(hello.nonce, what="nonce", length=32),
                    workload_id=identity.workload_id,
                    gateway_fingerprint=identity.fingerprint,
                )
                ws.send(
                    p.Auth(
                        workload_id=identity.workload_id, credential=self.enrolment.credential, proof=proof,
                        agent_version="0.1.0-test", process_start_id=self.process, uptime_seconds=1.0,
                        owned_table="present",
                    ).encode()
                )  # fmt: skip
                p.decode(ws.recv(timeout=20), sender="gateway")  # welcome
                next_beat = time.monotonic()
                while not self.stopping.is_set():
                    with self._lock:
                        pending, self._send_now = self._send_now, []
                    for message in pending:
                        ws.send(message.encode())
                    if time.monotonic() >= next_beat:
                        next_beat += self.every
                        self.heartbeats += 1
                        backlog = time.strftime(
                            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(1_800_000_000 + self.heartbeats)
                        )
                        ws.send(
                            p.Heartbeat(
                                process_start_id=self.process, uptime_seconds=round(time.monotonic() - started, 3),
                                clock=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), owned_table="present",
                                flow_backlog_since=backlog,
                            ).encode()
                        )  # fmt: skip
                    try:
                        text = ws.recv(timeout=0.1)
                    except TimeoutError:
                        continue
                    message = p.decode(text, sender="gateway")
                    if isinstance(message, p.Snapshot):
                        self.snapshots.append(message)
                        ws.send(p.Applied(version=message.version).encode())
                        self.ready.set()
        except ConnectionClosed as closed:
            received = closed.rcvd
            self.closed = (received.code, received.reason) if received else (None, "no close frame")
        except Exception as error:  # noqa: BLE001 - reported to the test
            self.error = f"{type(error).__name__}: {error}"

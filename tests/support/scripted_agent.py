"""Agents that put their workload into one chosen state on the real serve, by speaking the stream
protocol from agent/protocol.py with an enrolled agent's real key and credential: degraded (the apply
failed), enforcement removed (the table is gone), renewal failed, pending (never acknowledges), a late
renewal. The streams stay open on a background event loop until `close()`, heartbeating, so the state
holds while a browser looks at it.

    streams = ScriptedStreams()
    streams.hold(StateDir(path).load_enrolment(), role="degraded")
    ...
    streams.close()
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

from websockets.asyncio.client import connect

from agent import protocol as p
from agent.state import Enrolment
from agent.tls import pinned_context

ROLES = ("synced", "degraded", "removed", "renewal-failed", "pending", "renew-late")


class ScriptedStreams:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tasks: list[asyncio.Future] = []
        self.errors: list[str] = []

    def hold(self, enrolment: Enrolment, *, role: str, timeout: float = 30) -> None:
        """Open the stream and return once the workload is in the role's state (as the agent saw it)."""
        assert role in ROLES, role
        ready = threading.Event()
        task = asyncio.run_coroutine_threadsafe(self._stream(enrolment, role, ready), self.loop)
        self.tasks.append(task)
        if not ready.wait(timeout):
            raise AssertionError(f"the {role} stream did not get there: {self.errors or task}")

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        time.sleep(0.2)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _stream(self, enrolment: Enrolment, role: str, ready: threading.Event) -> None:
        identity = enrolment.identity
        started, process = time.monotonic(), str(uuid.uuid4())
        try:
            async with connect(
                f"wss://{identity.gateway}{p.STREAM_PATH}", ssl=pinned_context(identity.certificate_pem)
            ) as ws:
                hello = p.decode(await ws.recv(), sender="gateway")
                nonce = p.b64decode(hello.nonce, what="nonce", length=32)
                proof = p.sign_proof(
                    enrolment.key,
                    nonce=nonce,
                    workload_id=identity.workload_id,
                    gateway_fingerprint=identity.fingerprint,
                )
                await ws.send(
                    p.Auth(
                        workload_id=identity.workload_id, credential=enrolment.credential, proof=proof,
                        agent_version="0.1.0-scripted", process_start_id=process, uptime_seconds=1.0,
                        owned_table="present",
                    ).encode()
                )  # fmt: skip
                welcome = p.decode(await ws.recv(), sender="gateway")
                if role == "renew-late":
                    assert welcome.renew_only, welcome
                    await ws.send(p.Renew().encode())
                    issued = p.decode(await ws.recv(), sender="gateway")
                    assert isinstance(issued, p.CredentialIssued), issued
                    ready.set()
                    return
                if role == "renewal-failed":
                    await ws.send(p.RenewalFailed(error="could not write the credential: disk full").encode())
                async for text in ws:
                    message = p.decode(text, sender="gateway")
                    if isinstance(message, p.Snapshot):
                        if role == "degraded":
                            await ws.send(
                                p.Failed(
                                    version=message.version, error="Error: Could not process rule"
                                ).encode()
                            )
                        elif role != "pending":
                            await ws.send(p.Applied(version=message.version).encode())
                        if role == "removed":
                            await ws.send(p.TableState(state="absent").encode())
                        await asyncio.sleep(0.5)  # the gateway records it before anyone looks
                        ready.set()
                        self.tasks.append(self.loop.create_task(self._heartbeats(ws, process, started, role)))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - reported by hold()
            self.errors.append(f"{role}: {error!r}")

    async def _heartbeats(self, ws, process: str, started: float, role: str) -> None:
        table = "absent" if role == "removed" else "present"
        while True:
            await asyncio.sleep(2)
            await ws.send(
                p.Heartbeat(
                    process_start_id=process,
                    uptime_seconds=round(time.monotonic() - started, 3),
                    clock=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    owned_table=table,
                ).encode()
            )

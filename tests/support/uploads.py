"""Request bodies sent by hand to the real serve: a head, then as much of the body as a test likes, when it
likes (tests/e2e/test_gateway_bodies.py, test_gateway_fair_shares.py)."""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time

from agent.protocol import FLOWS_PATH

ANSWER_TIMEOUT = 15.0


def flow_report_head(
    workload: str, credential: str, *, length: int | None, expect: bool = False
) -> dict[str, str]:
    """A flow report's headers with a signature that will not verify: what decides before the body is
    the workload and its credential."""
    headers = {
        "Content-Type": "application/json",
        "Palisade-Workload": workload,
        "Palisade-Credential": credential,
        "Palisade-Signature": "A" * 86 + "==",
    }
    if length is None:
        headers["Transfer-Encoding"] = "chunked"
    else:
        headers["Content-Length"] = str(length)
    if expect:
        headers["Expect"] = "100-continue"
    return headers


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Upload:
    """One POST over its own TLS connection, driven by hand. `serve.gateway_context` (or the listener's)
    is the client's pinned TLS context."""

    def __init__(
        self,
        serve,
        headers: dict[str, str],
        *,
        listener: str = "gateway",
        path: str = FLOWS_PATH,
        timeout: float = ANSWER_TIMEOUT,
    ):
        host, port = serve.address(listener)
        raw = socket.create_connection((host, port), timeout=timeout)
        self.tls = getattr(serve, f"{listener}_context").wrap_socket(raw)
        head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        self.tls.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        self.buffer = b""

    def send(self, data: bytes) -> bool:
        try:
            self.tls.sendall(data)
            return True
        except OSError:
            return False

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        """The next response (status, headers, body); (0, {}, b"") when none came in time."""
        try:
            while b"\r\n\r\n" not in self.buffer:
                if not self._read():
                    return 0, {}, b""
            head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
            }
            length = int(headers.get("content-length", 0))
            while len(self.buffer) < length:
                if not self._read():
                    return 0, {}, b""
            body, self.buffer = self.buffer[:length], self.buffer[length:]
            return status, headers, body
        except (OSError, ssl.SSLError):
            return 0, {}, b""

    def _read(self) -> bool:
        data = self.tls.recv(65536)
        self.buffer += data
        return bool(data)

    def close(self) -> None:
        try:
            self.tls.close()
        except OSError:
            pass


class Trickle(threading.Thread):
    """Sends an upload's body at `rate` bytes a second (chunked when `chunked`), a piece every `step`
    seconds, and watches for the server's answer or close meanwhile, on this one thread (a TLS socket is
    not for two). `ended` says how it ended: None while it goes on, "answered" (then `status`), "closed"
    (the server closed the connection without an answer) or "stopped"."""

    def __init__(self, upload: Upload, *, rate: float = 1600.0, step: float = 0.1, chunked: bool = False):
        super().__init__(daemon=True)
        self.upload, self.rate, self.step, self.chunked = upload, rate, step, chunked
        self.stopping = threading.Event()
        self.ended: str | None = None
        self.status = 0
        self.sent = 0
        self.ended_at: float | None = None

    def run(self) -> None:
        piece = b"x" * max(1, int(self.rate * self.step))
        self.upload.tls.setblocking(False)
        while not self.stopping.is_set():
            if self.rate:
                try:
                    self.upload.tls.sendall(chunk(piece) if self.chunked else piece)
                    self.sent += len(piece)
                except ssl.SSLWantWriteError:
                    pass
                except OSError:
                    self._end("closed")
                    return
            readable, _, _ = select.select([self.upload.tls], [], [], self.step)
            if readable or self.upload.tls.pending():
                try:
                    data = self.upload.tls.recv(65536)
                except ssl.SSLWantReadError:
                    continue
                except OSError:
                    self._end("closed")
                    return
                if not data:
                    self._end("closed")
                    return
                self.status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
                self._end("answered")
                return
        self._end("stopped")

    def _end(self, how: str) -> None:
        self.ended, self.ended_at = how, time.monotonic()

    def stop(self) -> None:
        self.stopping.set()
        self.join(5)
        self.upload.close()

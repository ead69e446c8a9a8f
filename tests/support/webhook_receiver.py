"""A real HTTPS webhook receiver in the test process: scripted answers, every request recorded, and
able to go away and come back on the same port (a receiver that is down)."""

from __future__ import annotations

import http.server
import json
import ssl
import threading
import time
from pathlib import Path

from controlplane.tls import ensure_certificate
from tests.support.serve_process import free_port


class _Handler(http.server.BaseHTTPRequestHandler):
    receiver: Receiver

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.receiver.holding is not None:
            self.receiver.hold(self)
            return
        status = self.receiver.answer(dict(self.headers), body)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


HOLDING = ("slow", "trickling", "silent")


class Receiver:
    """`fail_first` answers 500 before answering 200; `delay` seconds before each answer.

    With `holding` (one of HOLDING) and a `release` event, it holds every request until the event is
    set: `slow` then answers 200, `trickling` sends its answer a byte every 0.2 s meanwhile (and ends
    it then), `silent` never answers. `held` counts the requests that came, `done` those it let go."""

    def __init__(
        self,
        directory: Path,
        *,
        fail_first: int = 0,
        delay: float = 0.0,
        holding: str | None = None,
        release: threading.Event | None = None,
    ):
        paths = ensure_certificate(directory, "receiver", ["127.0.0.1"])
        self.ca_file = str(paths.cert_path)
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(paths.cert_path, paths.key_path)
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}/hooks/palisade"
        self.fail_first, self.delay = fail_first, delay
        assert holding is None or (holding in HOLDING and release is not None)
        self.holding, self.release = holding, release
        self.held = self.done = 0
        self.requests: list[tuple[dict, bytes, int]] = []  # headers, body, the status answered
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None

    def answer(self, headers: dict, body: bytes) -> int:
        time.sleep(self.delay)
        with self._lock:
            status = 500 if self.fail_first > 0 else 200
            self.fail_first -= 1
            self.requests.append((headers, body, status))
            return status

    def hold(self, handler: _Handler) -> None:
        assert self.release is not None
        with self._lock:
            self.held += 1
        try:
            if self.holding == "trickling":
                # A byte every 0.2 s: no read of the sender's ever waits long, the answer never ends.
                handler.wfile.write(b"HTTP/1.1 200 OK\r\nX-Padding: ")
                while not self.release.wait(0.2):
                    handler.wfile.write(b"a")
                    handler.wfile.flush()
                handler.wfile.write(b"\r\nContent-Length: 0\r\n\r\n")
            self.release.wait(120)
            if self.holding == "slow":
                handler.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        except OSError:
            pass  # the sender gave up on us first
        finally:
            handler.close_connection = True
            with self._lock:
                self.done += 1

    def start(self) -> Receiver:
        handler = type("Handler", (_Handler,), {"receiver": self})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        server.socket = self._context.wrap_socket(server.socket, server_side=True)
        server.daemon_threads = True
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def delivered(self) -> list[tuple[dict, dict]]:
        """(headers, payload) of each request answered 200, in arrival order."""
        with self._lock:
            return [(h, json.loads(b)) for h, b, status in self.requests if status == 200]

    def wait_for(self, condition, timeout: float = 60.0, what: str = "deliveries"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition(self):
                return
            time.sleep(0.05)
        raise AssertionError(f"{what} did not arrive within {timeout} s; got {len(self.requests)} requests")

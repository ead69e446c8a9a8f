"""A control plane and real agents in network namespaces: `serve` in one namespace, each agent in its
own, joined by a bridge (tests/support/netns.py). The test process reaches the operator API from a thread that
joins the control plane's namespace (tests/support/nsthread.py); nothing touches the host's own namespace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

from tests.support.netns import REPO, Lab
from tests.support.nsthread import NamespaceThread
from tests.support.serve_process import ServeProcess, _drain, served_certificate

POSTGRES_SOCKET_DIR = "/var/run/postgresql"


def via_unix_socket(database_url: str | None) -> str | None:
    """The same PostgreSQL database over its Unix socket, which every network namespace can reach."""
    if not database_url:
        return None
    parts = urlsplit(database_url)
    user = parts.username or "postgres"
    return urlunsplit(("postgresql", f"{user}@", parts.path, f"host={POSTGRES_SOCKET_DIR}", ""))


class NamespacedServe(ServeProcess):
    """`manage.py serve` inside a lab namespace."""

    def __init__(self, lab: Lab, ns: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lab, self.ns = lab, ns
        self.thread = NamespaceThread(lab.ns(ns))

    @property
    def args(self) -> list[str]:
        return ["ip", "netns", "exec", self.lab.ns(self.ns), *super().args]

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        for listener in ("operator", "gateway"):
            while True:
                if self.process.poll() is not None:
                    self._wait_for_drain()
                    raise AssertionError(f"serve exited {self.process.returncode}:\n{self.stderr_text()}")
                try:
                    self._served[listener] = self.thread.call(served_certificate, *self.address(listener), 2)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"serve did not listen:\n{self.stderr_text()}") from None
                    time.sleep(0.1)

    def api(self, token: str) -> OperatorApi:
        return OperatorApi(self, token)


class OperatorApi:
    """The operator API over TLS from inside the control plane's namespace."""

    def __init__(self, serve: NamespacedServe, token: str):
        self.thread = serve.thread
        self.client = self.thread.call(
            lambda: serve.client("operator", headers={"Authorization": f"Bearer {token}"})
        )

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        return self.thread.call(lambda: self.client.request(method, "/api/v1" + path, **kwargs))

    def get(self, path: str, **kwargs) -> dict:
        response = self.request("GET", path, **kwargs)
        assert response.status_code == 200, response.text
        return response.json()

    def post(self, path: str, body: dict | None = None) -> httpx.Response:
        return self.request("POST", path, json=body)

    def workload(self, workload_id: str) -> dict:
        return self.get(f"/workloads/{workload_id}")

    def wait_for(self, what: str, predicate, timeout: float = 60.0, interval: float = 0.3):
        """Poll until predicate() returns something truthy; fail with `what` and the last value."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(interval)
        raise AssertionError(f"timed out waiting for {what}; last: {last!r}")

    def wait_converged(self, workload_id: str, timeout: float = 60.0) -> dict:
        def converged():
            w = self.workload(workload_id)
            return (
                w if w["sync"]["state"] == "synced" and w["applied_version"] == w["latest_version"] else None
            )

        return self.wait_for(f"{workload_id} synced with applied == latest", converged, timeout)


class AgentProcess:
    """`python -m agent run` inside a lab namespace, its log lines collected."""

    def __init__(self, lab: Lab, ns: str, state_dir: Path):
        self.lab, self.ns, self.state_dir = lab, ns, state_dir
        self.process: subprocess.Popen | None = None
        self.lines: list[str] = []

    def cli(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        return self.lab.run(
            self.ns, [sys.executable, "-m", "agent", *args], input=input, env=env, timeout=60, cwd=REPO
        )

    def enrol(self, bundle: str, *addresses: str) -> str:
        done = self.cli(
            "enrol",
            "--bundle-file",
            "-",
            "--state-dir",
            str(self.state_dir),
            "--hostname",
            self.ns,
            *[arg for address in addresses for arg in ("--address", address)],
            input=bundle,
        )
        assert done.returncode == 0, done.stderr
        return json.loads((self.state_dir / "identity.json").read_text())["workload_id"]

    def start(self, *extra_args: str, env: dict[str, str] | None = None) -> AgentProcess:
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **(env or {}))
        self.process = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.lab.ns(self.ns),
                sys.executable,
                "-m",
                "agent",
                "run",
                "--state-dir",
                str(self.state_dir),
                "--heartbeat-seconds",
                "2",
                *extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        threading.Thread(target=_drain, args=(self.process.stderr, self.lines), daemon=True).start()
        return self

    def kill(self, sig: int = signal.SIGKILL) -> int:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            return self.process.wait(20)
        return self.process.returncode if self.process else 0

    def log(self) -> str:
        return "".join(self.lines)


TCP_SERVER = """
import socket, sys, threading
def serve(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        c, _ = s.accept(); c.sendall(b"hi"); c.close()
for port in map(int, sys.argv[1:]):
    threading.Thread(target=serve, args=(port,), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""

# A TCP relay (listen address, target address) that stands for a middlebox between agents and the
# gateway: told "cut SECONDS" on stdin, it ends every connection older than that, as a firewall with a
# short lifetime for connections would ("cut 0": the gateway unreachable, every connection refused);
# "hold" refuses new connections and keeps those made (a stream stays up, a flow report cannot get
# through); "pass" lets them live again. It answers each command "ok".
CUTTING_RELAY = """
import socket, sys, threading, time
def address(text):
    host, _, port = text.rpartition(":")
    return host, int(port)
lifetime, holding, links, lock = [None], [False], [], threading.Lock()
def pipe(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
def accept(listener, target):
    while True:
        a, _ = listener.accept()
        if lifetime[0] == 0 or holding[0]:
            a.close()
            continue
        try:
            b = socket.create_connection(target)
        except OSError:
            a.close()
            continue
        with lock:
            links.append((time.monotonic(), a, b))
        threading.Thread(target=pipe, args=(a, b), daemon=True).start()
        threading.Thread(target=pipe, args=(b, a), daemon=True).start()
def cut():
    while True:
        time.sleep(0.1)
        with lock:
            for link in list(links):
                born, a, b = link
                if lifetime[0] is not None and time.monotonic() - born > lifetime[0]:
                    links.remove(link)
                    for s in (a, b):
                        try:
                            s.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
listener = socket.create_server(address(sys.argv[1]))
threading.Thread(target=accept, args=(listener, address(sys.argv[2])), daemon=True).start()
threading.Thread(target=cut, daemon=True).start()
print("ready", flush=True)
for line in sys.stdin:
    word, *rest = line.split()
    lifetime[0] = float(rest[0]) if word == "cut" else None
    holding[0] = word == "hold"
    print("ok", flush=True)
"""

TCP_PROBE = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5)
    print("open" if c.recv(2) == b"hi" else "bad")
except OSError as error:
    print("closed")
"""


def probe(lab: Lab, ns: str, host: str, port: int) -> str:
    return lab.python(ns, TCP_PROBE, host, str(port)).stdout.strip()

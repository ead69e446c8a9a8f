"""The bound on stream authentications in progress, on the real serve over TLS (fleet/admission.py):
under it nothing changes; past it a new stream is closed at once with 4503 and `retry after N s`,
the agent waits that long and connects then; the refusals are counted in /metrics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest
from websockets.sync.client import connect

from agent.protocol import STREAM_PATH
from tests.support.serve_process import REPO, Site, pinned_context, terminate

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

BOUND = 2
REFUSED = re.compile(
    r'stream closed code=4503 reason="busy: too many streams authenticating: retry after ([0-9]+) s"'
)


def _simulator(bundle, state_root) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "agent", "simulate", "--bundle-file", str(bundle), "--count", str(BOUND),
         "--state-root", str(state_root), "--heartbeat-seconds", "1", "--verbose"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, start_new_session=True,
    )  # fmt: skip


class Lines(threading.Thread):
    def __init__(self, stream) -> None:
        super().__init__(daemon=True)
        self.stream, self.lines = stream, []
        self.start()

    def run(self) -> None:
        for line in self.stream:
            self.lines.append(line)


class Holder(threading.Thread):
    """Streams that upgrade and never authenticate: each holds one of the bound's places until serve
    closes it (4408 after its handshake time); then it opens another, until stopped."""

    def __init__(self, serve, count: int) -> None:
        super().__init__(daemon=True)
        host, port = serve.address("gateway")
        self.url = f"wss://{host}:{port}{STREAM_PATH}"
        self.context = pinned_context(serve.served_certificate("gateway"))
        self.count = count
        self.held: list = []
        self.stopping = threading.Event()
        self.holding = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.held = [s for s in self.held if s.state.name == "OPEN"]
            while len(self.held) < self.count:
                socket = connect(self.url, ssl=self.context, open_timeout=5)
                try:
                    socket.recv(5)  # hello: admitted (a refused one is closed instead)
                except Exception:  # noqa: BLE001 - refused: an agent holds the place; try again
                    socket.close()
                    time.sleep(0.05)
                    continue
                self.held.append(socket)
            self.holding.set()
            self.stopping.wait(0.05)
        for socket in self.held:
            socket.close()


def _synced(http, count: int) -> bool:
    items = http.get("/api/v1/workloads").json()["items"]
    return len(items) == count and all(
        w["sync"]["state"] == "synced" and w["applied_version"] == w["latest_version"] for w in items
    )


def _wait(done, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if done():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s")


def _refused(http) -> float:
    text = http.get("/metrics", headers={"Accept": "text/plain"}).text
    return float(re.search(r"^palisade_stream_admissions_refused_total (\S+)$", text, re.M)[1])


def test_past_the_bound_a_stream_is_told_when_to_come_back_and_comes_back(tmp_path):
    env = {"PALISADE_STREAM_AUTHENTICATIONS": str(BOUND), "REDIS_URL": os.environ.get("REDIS_TEST_URL", "")}
    with Site.fresh(tmp_path / "data") as site:
        serve = site.serve(env=env)
        http = serve.client("operator", headers={"Authorization": f"Bearer {serve.mint_operator_token()}"})
        minted = http.post("/api/v1/provisioning-tokens", json={"description": "adm", "max_uses": BOUND})
        bundle = tmp_path / "bundle.txt"
        bundle.write_text(minted.json()["bundle"])

        # Under the bound: as many agents as it admits connect together, none is refused.
        simulator = _simulator(bundle, tmp_path / "agents")
        try:
            lines = Lines(simulator.stderr)
            _wait(lambda: _synced(http, BOUND), 60, "the agents synced under the bound")
        finally:
            terminate(simulator)
        assert not [line for line in lines.lines if "code=4503" in line]
        assert _refused(http) == 0

        # Past it: every place held by a stream that does not authenticate; the same agents come back.
        holder = Holder(serve, BOUND)
        holder.start()
        simulator = None
        try:
            assert holder.holding.wait(20)
            simulator = _simulator(bundle, tmp_path / "agents")
            lines = Lines(simulator.stderr)
            try:
                _wait(
                    lambda: any(REFUSED.search(line) for line in lines.lines),
                    30,
                    "an agent refused with 4503",
                )
            except AssertionError as error:
                raise AssertionError(f"{error}; the agents said: {''.join(lines.lines[-20:])}") from None
            waits = [int(m[1]) for line in lines.lines if (m := REFUSED.search(line))]
            assert all(1 <= w <= 300 for w in waits), waits
            refused_at = time.monotonic()
            holder.stopping.set()
            holder.join(10)
            _wait(lambda: _synced(http, BOUND), 60, "the refused agents connected once room was made")
            took = time.monotonic() - refused_at
            assert took >= 0.5  # they waited to be told to come back, not connected at once
        finally:
            holder.stopping.set()
            if simulator is not None:
                terminate(simulator)
        assert _refused(http) >= len(waits)
        assert "Traceback" not in serve.stderr_text()
        http.close()

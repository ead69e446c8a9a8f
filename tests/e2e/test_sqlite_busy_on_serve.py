"""The embedded SQLite database held by another writer (a long write that cannot be split: here another
process holding its write lock), under the real serve: an operator's write, an agent's flow report and
a stream's heartbeats wait their short while and are then answered 503 with Retry-After, never a 500
or a traceback; reads go on (WAL); the stream stays up and records its next heartbeat once the
database is free, and everything refused then goes through."""

from __future__ import annotations

import math
import subprocess
import sys
import time
import uuid

import pytest

from agent.enrol import enrol
from agent.flowreport import report_body
from agent.state import StateDir
from tests.support.flow_reports import post_flow_report
from tests.support.serve_process import Site
from tests.support.sync_stream import SyncStream

pytestmark = pytest.mark.e2e

UNAVAILABLE = "urn:service:problem:service-unavailable"
# Holds SQLite's write lock on the database file until told to let go (as a long write does).
LOCK_HOLDER = """
import sqlite3, sys
connection = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
connection.execute("BEGIN IMMEDIATE")
print("held", flush=True)
sys.stdin.readline()
connection.execute("ROLLBACK")
"""


def _report(seconds_ago: int) -> bytes:
    start = math.floor(time.time() / 60) * 60 - seconds_ago
    window = {
        "id": str(uuid.uuid4()), "start": start, "end": start + 60, "policy_version": "v", "accounting": False,
        "groups": [{"peer": "10.80.0.9", "protocol": "tcp", "port": 22, "decision": "observed", "rule": None,
                    "connection_count": 1, "first_seen": start + 1, "last_seen": start + 1,
                    "bytes_in": 0, "bytes_out": 0}],
    }  # fmt: skip
    return report_body(
        [window], [], now=time.time(), process_start_id="busy", uptime_seconds=60.0, window_seconds=60
    )


def _assert_unavailable(response, what: str) -> None:
    assert response.status_code == 503, f"{what}: {response.status_code} {response.text[:300]}"
    assert response.headers["content-type"] == "application/problem+json", what
    problem = response.json()
    assert problem["type"] == UNAVAILABLE and "busy" in problem["detail"], (what, problem)
    assert 5 <= int(response.headers["retry-after"]) <= 15 and problem["retry_after"] == int(
        response.headers["retry-after"]
    ), what


def test_a_busy_database_is_503_with_retry_after_and_the_stream_stays_up(tmp_path):
    site = Site(tmp_path / "data", None)  # SQLite whatever DATABASE_URL says
    serve = site.serve(
        env={"REDIS_URL": "", "PALISADE_SQLITE_WAIT_SECONDS": "2", "PALISADE_SQLITE_REPORT_WAIT_SECONDS": "1"}
    )
    holder = stream = None
    try:
        token = serve.mint_operator_token()
        http = serve.client("operator", headers={"Authorization": f"Bearer {token}"})
        bundle = http.post("/api/v1/provisioning-tokens", json={"description": "busy"}).json()["bundle"]
        enrol(bundle, str(tmp_path / "web"), hostname="web", addresses=["10.80.0.1"])
        agent = StateDir(tmp_path / "web").load_enrolment()
        stream = SyncStream(agent, every=0.5).started()
        report = _report(180)

        holder = subprocess.Popen(
            [sys.executable, "-c", LOCK_HOLDER, str(tmp_path / "data" / "palisade.sqlite3")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert holder.stdout.readline().strip() == "held"
        beats_before = stream.heartbeats
        # Each waits its while (2 s; a report 1 s), not until the other writer is done: that one never is.
        write = http.post(
            "/api/v1/services", json={"name": "ssh", "entries": [{"protocol": "tcp", "port": 22}]}
        )
        _assert_unavailable(write, "an operator's write")
        assert http.get("/api/v1/workloads").status_code == 200  # readers never wait for the writer
        refused = post_flow_report(serve, agent, report)
        _assert_unavailable(refused, "a flow report")
        serve.wait_for_stderr(r"database busy: cannot record heartbeats", timeout=20)
        stream.wait_for(
            "heartbeats while the database is busy", lambda: stream.heartbeats >= beats_before + 6
        )
        assert stream.closed is None and stream.error is None, (stream.closed, stream.error)
        heard_while_busy = http.get(f"/api/v1/workloads/{agent.identity.workload_id}").json()["sync"][
            "last_heard_from"
        ]

        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(10) == 0
        # The stream is still up: a change reaches it, and its heartbeats are written again.
        snapshots = len(stream.snapshots)
        changed = http.post("/api/v1/mode-changes", json={"selection": {"all": True}, "mode": "simulation"})
        assert changed.status_code in (200, 201, 202), changed.text
        stream.wait_for("the change's snapshot", lambda: len(stream.snapshots) > snapshots)
        stream.wait_for(
            "a heartbeat written after the database is free",
            lambda: (
                http.get(f"/api/v1/workloads/{agent.identity.workload_id}").json()["sync"]["last_heard_from"]
                != heard_while_busy
            ),
        )
        assert stream.closed is None and stream.error is None, (stream.closed, stream.error)
        stored = post_flow_report(serve, agent, report)  # the agent sends it again
        assert stored.status_code == 200 and stored.json()["windows"][0]["result"] == "accepted", stored.text
        again = http.post(
            "/api/v1/services", json={"name": "ssh", "entries": [{"protocol": "tcp", "port": 22}]}
        )
        assert again.status_code == 201, again.text
        http.close()
    finally:
        if stream is not None:
            stream.stop()
        if holder is not None and holder.poll() is None:
            holder.kill()
        assert serve.stop() == 0
    log = serve.stderr_text()
    assert "Traceback" not in log and " 500 " not in log, log[-3000:]
    assert "database unavailable" not in log  # busy is no outage

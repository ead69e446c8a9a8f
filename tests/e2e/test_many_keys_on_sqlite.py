"""An agent sending reports of 8 windows x 10,000 distinct peers, back to back from two connections,
against the real serve on its embedded SQLite database, while other agents report, their streams
heartbeat (every heartbeat a write), housekeeping runs and an operator writes: nobody gets a 500 (the
many-keys agent itself at most a 503 to send again), the others are never turned away, no stream is
dropped, no housekeeping round fails and each keeps running, and what the agent sent over the bounds
is in its windows' aggregate keys, said by `keys_aggregated` gaps."""

from __future__ import annotations

import itertools
import math
import threading
import time
import uuid
import warnings

import pytest

from agent.enrol import enrol
from agent.flowreport import instant, report_body
from agent.state import StateDir
from tests.support.agent_helpers import metric_samples
from tests.support.flow_reports import post_flow_report
from tests.support.serve_process import Site
from tests.support.sync_stream import SyncStream

pytestmark = pytest.mark.e2e

WINDOWS, KEYS = 8, 10_000
OTHERS = 3
LOAD_SECONDS = 40  # at least; and until housekeeping has summed windows during the load
PER_WINDOW, PER_REPORT = 10_000, 20_000  # serve's defaults (PALISADE_FLOW_WINDOW_MAX_KEYS, ..._REPORT_...)


def _stream_opened(enrolment) -> SyncStream:
    """A stream of the idle serve, before any load: tried once more when the first connection ends
    without an HTTP answer (seen once in CI on 2026-11-29, on a fresh serve, cause not found), as a
    real agent reconnects after its backoff. The first failure stays visible as a warning in the
    run's summary; what this test claims is about the load that follows."""
    try:
        return SyncStream(enrolment).started()
    except AssertionError as first:
        warnings.warn(f"a stream of the idle serve did not open at the first try: {first}", stacklevel=2)
        return SyncStream(enrolment).started()


class Load(threading.Thread):
    """Calls `call` in a loop until stopped, keeping (what, status, seconds, text) of every answer."""

    def __init__(self, name: str, call, pause: float = 0.0):
        super().__init__(daemon=True, name=name)
        self.call, self.pause = call, pause
        self.answers: list[tuple[str, int | str, float, str]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        for count in itertools.count():
            if self.stopping.is_set():
                return
            began = time.monotonic()
            try:
                response = self.call(count)
                status, text = response.status_code, response.text[:300]
            except Exception as error:  # noqa: BLE001 - no answer at all is what the test looks for
                status, text = "no answer", f"{type(error).__name__}: {error}"
            self.answers.append((self.name, status, time.monotonic() - began, text))
            self.stopping.wait(self.pause)

    def stop(self) -> None:
        self.stopping.set()
        self.join(120)


def _many_keys_body(start: float) -> tuple[str, list[str]]:
    """One report's body with placeholder window ids (replaced per report: each report is new windows)."""
    ids = [f"00000000-0000-4000-8000-{i:012d}" for i in range(WINDOWS)]
    windows = [
        {"id": ids[w], "start": start + 60 * w, "end": start + 60 * w + 60, "policy_version": "v",
         "accounting": False,
         "groups": [{"peer": f"10.{100 + w}.{k // 256}.{k % 256}", "protocol": "tcp", "port": 443,
                     "decision": "observed", "rule": None, "connection_count": 1 + k % 3,
                     "first_seen": start + 60 * w + 1, "last_seen": start + 60 * w + 2,
                     "bytes_in": 0, "bytes_out": 0} for k in range(KEYS)]}
        for w in range(WINDOWS)
    ]  # fmt: skip
    body = report_body(
        windows, [], now=time.time(), process_start_id="many", uptime_seconds=60.0, window_seconds=60
    )
    return body.decode(), ids


def _small_body(count: int) -> bytes:
    start = math.floor(time.time() / 60) * 60 - 120
    window = {
        "id": str(uuid.uuid4()), "start": start, "end": start + 60, "policy_version": "v", "accounting": False,
        "groups": [{"peer": f"10.90.0.{k}", "protocol": "tcp", "port": 22, "decision": "allowed", "rule": None,
                    "connection_count": 1, "first_seen": start + 1, "last_seen": start + 1,
                    "bytes_in": 0, "bytes_out": 0} for k in range(1, 6)],
    }  # fmt: skip
    return report_body([window], [], now=time.time(), process_start_id="small", uptime_seconds=60.0 + count,
                       window_seconds=60)  # fmt: skip


def _every_item(http, path: str, params: dict) -> list[dict]:
    items, cursor = [], None
    while True:
        page = http.get(path, params={**params, **({"cursor": cursor} if cursor else {})}).json()
        items += page["items"]
        cursor = page["next_cursor"]
        if not cursor:
            return items


def _housekeeping(http) -> dict[tuple[str, str], float]:
    samples = metric_samples(http.get("/metrics", headers={"Accept": "text/plain"}).text)
    return {
        (name, dict(labels)["step"]): value
        for (name, labels), value in samples.items()
        if name.startswith("palisade_housekeeping_")
    }


def test_a_many_keys_agent_on_sqlite_holds_up_nobody_else(tmp_path):
    site = Site(tmp_path / "data", None)  # the embedded SQLite database whatever DATABASE_URL says
    serve = site.serve(env={"REDIS_URL": ""}, migrated=True)
    loads: list[Load] = []
    streams: list[SyncStream] = []
    try:
        token = serve.mint_operator_token()
        http = serve.client("operator", headers={"Authorization": f"Bearer {token}"})
        bundle = http.post(
            "/api/v1/provisioning-tokens", json={"description": "many", "max_uses": 2 + 2 * OTHERS}
        ).json()["bundle"]
        names = ["many", *(f"agent-{i}" for i in range(OTHERS)), *(f"stream-{i}" for i in range(OTHERS))]
        for i, name in enumerate(names):
            enrol(bundle, str(tmp_path / name), hostname=name, addresses=[f"10.70.0.{i + 1}"])
        agents = {name: StateDir(tmp_path / name).load_enrolment() for name in names}
        streams = [_stream_opened(agents[f"stream-{i}"]) for i in range(OTHERS)]

        start = math.floor(time.time() / 60) * 60 - 60 * (WINDOWS + 5)  # due for summing already
        template, placeholders = _many_keys_body(start)
        sent_windows: list[list[str]] = []

        def many_keys(count: int):
            ids = [str(uuid.uuid4()) for _ in placeholders]
            body = template
            for placeholder, new in zip(placeholders, ids, strict=True):
                body = body.replace(placeholder, new)
            response = post_flow_report(serve, agents["many"], body.encode())
            if response.status_code == 200:
                sent_windows.append(ids)
            return response

        services = itertools.count()

        def operator(count: int):
            if count % 2:
                return http.get("/api/v1/workloads")
            return http.post(
                "/api/v1/services",
                json={
                    "name": f"svc-{next(services)}",
                    "entries": [{"protocol": "tcp", "port": 8000 + count}],
                },
            )

        hostile = [Load(f"many-keys-{i}", many_keys) for i in range(2)]
        others = [
            Load(f"agent-{i}", lambda count, i=i: post_flow_report(serve, agents[f"agent-{i}"], _small_body(count)), 0.5)
            for i in range(OTHERS)
        ]  # fmt: skip
        operator_load = Load("operator", operator, 1.0)
        loads = [*hostile, *others, operator_load]
        load_began = time.time()
        for load in loads:
            load.start()
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            time.sleep(2)
            summed_at = _housekeeping(http).get(
                ("palisade_housekeeping_last_success_timestamp_seconds", "flow_windows_sum"), 0
            )
            if time.time() - load_began >= LOAD_SECONDS and summed_at > load_began and len(sent_windows) >= 2:
                break
        for load in loads:
            load.stop()
        load_ended = time.time()

        # Housekeeping ran on time throughout: no round failed, the sums ran during the load, and the
        # steps of a few seconds' period last succeeded a few seconds ago.
        housekeeping = _housekeeping(http)
        failed = {
            step: n for (name, step), n in housekeeping.items() if name.endswith("failures_total") and n
        }
        assert not failed, failed
        last = {step: t for (name, step), t in housekeeping.items() if name.endswith("timestamp_seconds")}
        assert last["flow_windows_sum"] > load_began, last
        assert load_ended - last["webhooks_send"] < 20 and load_ended - last["streams_catch_up"] < 20, last

        # Every stream is still up: a change reaches each of them.
        before = [len(stream.snapshots) for stream in streams]
        changed = http.post("/api/v1/mode-changes", json={"selection": {"all": True}, "mode": "simulation"})
        assert changed.status_code in (200, 201, 202), changed.text
        for stream, seen in zip(streams, before, strict=True):
            stream.wait_for("the change's snapshot", lambda s=stream, n=seen: len(s.snapshots) > n)
            assert stream.closed is None and stream.error is None, (stream.closed, stream.error)

        # What the many-keys agent sent over the bounds is summed, not dropped, and said so: of all it
        # sent for its eight minutes, the first report it got stored keeps the keys of two windows
        # (10,000 each, 20,000 a report); every other window it sent holds its aggregate key alone.
        workload = agents["many"].identity.workload_id
        span = {"from": instant(start - 60), "to": instant(time.time() + 60), "workload": workload}
        gaps = _every_item(http, "/api/v1/flows/gaps", span)
        summed = {w["id"]: w["groups"] for w in _every_item(http, "/api/v1/flows", {**span, "peer": "*"})}
        sent = [window_id for ids in sent_windows for window_id in ids]
        assert len(summed) == len(sent) - PER_REPORT // PER_WINDOW, (len(summed), len(sent))
        assert all(groups == [{**groups[0], "peer": "*"}] for groups in summed.values())
        assert {groups[0]["connection_count"] for groups in summed.values()} == {
            sum(1 + k % 3 for k in range(KEYS))
        }
        aggregated = [g for g in gaps if g["kind"] == "keys_aggregated"]
        assert len(aggregated) == len(summed) and {g["lost"]["keys"] for g in aggregated} == {KEYS}
        http.close()
    finally:
        for load in loads:
            load.stop()
        for stream in streams:
            stream.stop()
        assert serve.stop() == 0

    answers = [answer for load in loads for answer in load.answers]
    assert not [a for a in answers if a[1] == "no answer" or (isinstance(a[1], int) and a[1] >= 500 and a[1] != 503)], [
        a for a in answers if not isinstance(a[1], int) or a[1] >= 500
    ][:5]  # fmt: skip
    not_ok = [a for a in answers if not a[0].startswith("many-keys") and a[1] not in (200, 201)]
    assert not not_ok, not_ok[:5]  # the other agents and the operator are never turned away
    log = serve.stderr_text()
    assert "Traceback" not in log and "database busy" not in log, log[-3000:]

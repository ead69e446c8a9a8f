"""Heavy operator requests never stall serve: ten `POST /policies/suggestions` over a fleet's stored flows,
sent at once to the real serve on PostgreSQL while 2,000 simulated agents hold their sync streams, run
outside serve's own process and drop no stream.

The agents are `python -m agent simulate` (tests/support/simulated_fleet.py); the evidence is written
straight into the database (tests/support/stored_flows.py): one minute of KEYS_PER_WORKLOAD
observed keys from every workload, which each suggestion reads and sorts whole.

Where the work ran: the CPU time serve's own process spent while the suggestions ran, against the CPU
time of its child processes (the heavy workers, those still running and those it reaped). A serve that
ran these requests on threads of its own spent it all itself (children: none), held `GET /me` for
seconds here, and on a busy machine most of the fleet's streams missed their keepalives and reconnected.

What a dropped stream leaves behind, all checked: serve logs a new stream opening when the agent comes
back, daphne logs an application instance that "took too long to shut down", the workload's
`sync.last_snapshot_sent_at` moves (every new stream is sent a fresh snapshot), and `/workloads/counts`
counts it offline or pending meanwhile; the simulator's own count of its agents' streams is in the
message. The latencies of `GET /me` and of flow reports sent during the heavy requests are in the
message too; they are measured against their target by bench/bench_heavy.py, not asserted here.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

from tests.support.requirements import require
from tests.support.serve_process import Site
from tests.support.simulated_fleet import Probe, counts, simulated_agents, snapshots_sent
from tests.support.stored_flows import load_observed_flows, suggestion_request

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.alone]

AGENTS = 2000
KEYS_PER_WORKLOAD = int(os.environ.get("PALISADE_TEST_HEAVY_KEYS", 80))  # 160,000 keys in all
HEAVY = 10
QUIET_SECONDS = 5
SYNC_TIMEOUT = 600.0
HEAVY_TIMEOUT = 600.0
OPENED = re.compile(r"stream of \S+ opened")
TOO_LONG = "took too long to shut down"


@pytest.mark.timeout(SYNC_TIMEOUT + HEAVY_TIMEOUT + 300)
def test_ten_heavy_suggestions_run_outside_serve_and_drop_no_agent_stream(tmp_path):
    require(bool(os.environ.get("DATABASE_URL")), "needs PostgreSQL: set DATABASE_URL")
    with Site.fresh(tmp_path / "data", migrated=True) as site:
        # Every agent connects from 127.0.0.1: no per-address cap (docs/operations.md). The subject is
        # the streams, not the deadline (tests/e2e/test_heavy_workers_on_serve.py): a slow machine's
        # suggestions all run to their end.
        serve = site.serve(
            ["--max-connections-per-address", "0"],
            env={"REDIS_URL": "", "PALISADE_HEAVY_DEADLINE_SECONDS": str(HEAVY_TIMEOUT)},
        )
        token = serve.mint_operator_token()
        headers = {"Authorization": f"Bearer {token}"}
        with (
            serve.client("operator", headers=headers, timeout=HEAVY_TIMEOUT) as operator,
            simulated_agents(
                serve, operator, tmp_path / "fleet", count=AGENTS, timeout=SYNC_TIMEOUT
            ) as fleet,
        ):
            keys = load_observed_flows(site, keys_per_workload=KEYS_PER_WORKLOAD)
            sent_before = snapshots_sent(operator)
            log_before = len(serve.stderr_text())
            probe = Probe(serve, token, fleet.agent_dir(1))
            probe.start()

            body = suggestion_request()
            answers: list = [None] * HEAVY

            def suggest(index: int) -> None:
                with serve.client("operator", headers=headers, timeout=HEAVY_TIMEOUT) as own:
                    try:
                        response = own.post("/api/v1/policies/suggestions", json=body)
                        answers[index] = response.status_code
                    except Exception as error:  # noqa: BLE001 - what the message reports
                        answers[index] = f"{type(error).__name__}: {error}"

            # What serve spends on the fleet and the probe alone, per second, measured just before: the
            # heavy requests' share of serve is what it spent above that while they ran.
            quiet_before, quiet_started = serve.cpu_seconds()[0], time.monotonic()
            time.sleep(QUIET_SECONDS)
            serve_before, children_before = serve.cpu_seconds()
            started = time.monotonic()
            quiet_rate = (serve_before - quiet_before) / (started - quiet_started)
            heavy = [threading.Thread(target=suggest, args=(i,)) for i in range(HEAVY)]
            for thread in heavy:
                thread.start()
            for thread in heavy:
                thread.join(HEAVY_TIMEOUT)
            serve_after, children_after = serve.cpu_seconds()
            for_heavy = serve_after - serve_before - quiet_rate * (time.monotonic() - started)
            probe.stop.set()
            probe.join(60)

            log = serve.stderr_text()[log_before:]
            after = counts(operator)
            moved = [w for w, sent in snapshots_sent(operator).items() if sent != sent_before.get(w)]
            in_serve, in_children = serve_after - serve_before, children_after - children_before
            seen = (
                f"{keys} stored keys; heavy answers: {answers}; CPU seconds while they ran: serve "
                f"{in_serve:.1f} (above its rate before them, {quiet_rate:.2f}/s: {for_heavy:.1f}), its "
                f"child processes {in_children:.1f}; latencies meanwhile: "
                f"{json.dumps(probe.figures())}; after: {after}; streams opened again: {len(OPENED.findall(log))}; "
                f"'{TOO_LONG}': {log.count(TOO_LONG)}; snapshots sent again: {len(moved)}; the simulator's "
                f"agents: {fleet.last_summary()}"
            )
            assert answers == [200] * HEAVY, seen
            # Run in serve, the suggestions' work would be serve's (children: none); run in the heavy
            # workers, serve adds only the relaying of requests and answers to what the fleet costs it.
            assert in_children > max(for_heavy, 0.0), seen
            assert not OPENED.search(log) and TOO_LONG not in log, seen
            assert not moved, seen
            assert after["sync_state"]["synced"] == AGENTS, seen
            print(seen)

"""One `serve` process with thousands of simulated agents: connect, mode change, memory.

    .venv/bin/python bench/bench_fleet_scale.py [--counts 2000,5000] [--poll 0.25]

For each count, from nothing:

1. A throwaway PostgreSQL database (palisade_bench_scale_<pid>_<count> on BENCH_PG_ADMIN_URL's server,
   default postgresql://postgres@127.0.0.1:5432/postgres) and a temporary data directory; the real
   `manage.py serve` on 127.0.0.1 (tests/support/serve_process.py), in-memory channel layer (no REDIS_URL).
   Its RSS idle is read once it answers the API.
2. A provisioning token with max_uses = count, and `python -m agent simulate --count N` as a
   separate process on loopback (real agent code, RecordingDataplane, no kernel). Times: until the
   simulator has enrolled everyone (its `enrolled` line), and until GET /workloads/counts shows all
   N synced. The simulator starts agents at its fixed rate of 200 per second, so connecting N takes
   at least N / 200 s by design.
3. serve's RSS with the agents connected and idle; per agent = (RSS with agents - RSS idle) / N.
4. POST /mode-changes {"selection": {"all": true}, "mode": "simulation"}: time until every workload
   has applied its latest version (polling counts until synced == N), then a full walk of
   GET /workloads?limit=500 checks applied == latest and the mode on every item. Target: <= 10 s.

With --py-spy PATH (py-spy installed anywhere, e.g. `pip install --target /tmp/x py-spy`), serve is
sampled during the connect phase and the mode change (`py-spy record --format raw --threads --idle`,
collapsed stacks per thread, waiting included) into --profile-dir.

Everything is bounded in time; the simulator, serve, the database and temporary directories are
removed even on failure. Results: bench/results/fleet_scale.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchlib import exit_on_sigterm, results_write  # noqa: E402

from tests.support.serve_process import ServeProcess, terminate  # noqa: E402

ADMIN_URL = os.environ.get("BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
MODE_CHANGE_TARGET_S = 10.0
SIM_START_RATE = 200  # agent.simulated.SimulatedFleet.start_rate, not settable from the CLI

_t0 = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _t0:6.1f}s] {message}", flush=True)


def vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def postgres_cpu_seconds() -> float:
    """CPU time of every PostgreSQL server process on this machine (its backends come and go, so
    this is a floor: a backend that exited during a phase is not counted)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as handle:
                    if handle.read().strip() in ("postgres", "postmaster"):
                        total += cpu_seconds(int(entry))
            except OSError:
                continue
    return total


class CpuMeter:
    """Where the CPU time of a phase went: serve, the simulator, PostgreSQL; on a 2-core machine the
    three share two cores, so this says which one a faster phase must take work from."""

    def __init__(self, serve_pid: int, simulator_pid: int) -> None:
        self.pids = {"serve": serve_pid, "simulator": simulator_pid}
        self.started = time.monotonic()
        self.before = self._read()

    def _read(self) -> dict:
        return {
            **{name: cpu_seconds(pid) for name, pid in self.pids.items()},
            "postgres": postgres_cpu_seconds(),
        }

    def stop(self) -> dict:
        after = self._read()
        used = {name: round(after[name] - self.before[name], 2) for name in after}
        return {"wall_s": round(time.monotonic() - self.started, 2), "cpu_s": used}


def rss_settled(pid: int, seconds: float = 4.0, interval: float = 0.5) -> float:
    samples = []
    end = time.monotonic() + seconds
    while True:
        samples.append(vm_rss_mb(pid))
        if time.monotonic() >= end:
            return statistics.median(samples)
        time.sleep(interval)


def source_state() -> dict:
    """The commit measured, and tracked files that differed from it (read-only git commands)."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(REPO), *args], capture_output=True, text=True
        )
        return done.stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "modified": git("diff", "--name-only", "HEAD").split(),
    }


class Timeout(Exception):
    pass


class Lines:
    """A process's stderr lines, each with the monotonic time it arrived."""

    def __init__(self, stream) -> None:
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._drain, args=(stream,), daemon=True)
        self.thread.start()

    def _drain(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line))
        stream.close()

    def first(self, pattern: str) -> tuple[float, str] | None:
        for at, line in list(self.lines):
            if re.search(pattern, line):
                return at, line
        return None

    def tail(self, n: int = 20) -> str:
        return "".join(line for _, line in self.lines[-n:])


def database(name: str, *, create: bool) -> str:
    import psycopg

    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if create:
            admin.execute(f'CREATE DATABASE "{name}"')
    return urlunsplit(urlsplit(ADMIN_URL)._replace(path=f"/{name}"))


class Profile:
    """`py-spy record` of one process for one phase, when a py-spy binary was given."""

    def __init__(self, py_spy: str | None, pid: int, output: Path) -> None:
        self.process = None
        if py_spy:
            output.parent.mkdir(parents=True, exist_ok=True)
            self.process = subprocess.Popen(
                [py_spy, "record", "--pid", str(pid), "--format", "raw", "--threads", *os.environ.get("BENCH_PY_SPY_FLAGS", "--idle").split(), "--rate", "50",
                 "--nonblocking", "--output", str(output)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def run_count(
    count: int, poll: float, budget: float, py_spy: str | None = None, profile_dir: Path | None = None
) -> dict:
    deadline = time.monotonic() + budget

    def left(cap: float) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Timeout(f"the {count}-agent run ran out of its {budget:.0f} s")
        return min(cap, remaining)

    db_name = f"palisade_bench_scale_{os.getpid()}_{count}"
    work = Path(tempfile.mkdtemp(prefix=f"palisade-bench-scale-{count}-"))
    serve = sim = sim_lines = http = None
    result: dict = {"agents": count}
    try:
        db_url = database(db_name, create=True)
        # Every simulated agent connects from 127.0.0.1: lift serve's per-address cap (256) for them.
        serve = ServeProcess(work / "data", ["--max-connections-per-address", "0"], database_url=db_url)
        serve.start(timeout=left(120))
        token = serve.mint_operator_token("bench-scale")
        http = serve.client("operator", headers={"Authorization": f"Bearer {token}"})
        http.timeout = 120

        def get(path: str) -> dict:
            response = http.get("/api/v1" + path)
            if response.status_code != 200:
                raise RuntimeError(f"GET {path}: {response.status_code} {response.text[:500]}")
            return response.json()

        def post(path: str, body: dict) -> dict:
            response = http.post("/api/v1" + path, json=body)
            if response.status_code not in (200, 201, 202):
                raise RuntimeError(f"POST {path}: {response.status_code} {response.text[:500]}")
            return response.json()

        def wait_synced(what: str, cap: float, check=None) -> tuple[float, dict]:
            started = time.monotonic()
            end = started + left(cap)
            counts = None
            while time.monotonic() < end:
                counts = get("/workloads/counts")
                if counts["sync_state"]["synced"] == count and counts["total"] == count:
                    return time.monotonic(), counts
                if sim.poll() is not None:
                    raise RuntimeError(f"the simulator exited {sim.returncode}:\n{sim_lines.tail()}")
                if check:
                    check()
                time.sleep(poll)
            raise Timeout(f"{what}: not all {count} synced within {cap:.0f} s; last counts {counts}")

        for _ in range(3):
            get("/workloads/counts")
        bundle = post("/provisioning-tokens", {"description": f"bench scale {count}", "max_uses": count})[
            "bundle"
        ]
        time.sleep(2)
        result["serve_rss_idle_mb"] = rss_settled(serve.process.pid)
        log(f"{count}: serve idle RSS {result['serve_rss_idle_mb']:.1f} MB")

        bundle_file = work / "bundle.txt"
        bundle_file.write_text(bundle)
        started = time.monotonic()
        sim = subprocess.Popen(
            [sys.executable, "-m", "agent", "simulate", "--bundle-file", str(bundle_file), "--count", str(count),
             "--state-root", str(work / "agents")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, start_new_session=True,
        )  # fmt: skip
        sim_lines = Lines(sim.stderr)
        profile = Profile(py_spy, serve.process.pid, (profile_dir or work) / f"serve-{count}-connect.txt")
        try:
            all_synced, counts = wait_synced("connect", 120 + count * 0.2)
        finally:
            profile.stop()
        enrolled = sim_lines.first(r" enrolled agents=")
        connect = {
            "total_s": all_synced - started,
            "enrolment_s": (enrolled[0] - started) if enrolled else None,
            "after_enrolment_s": (all_synced - enrolled[0]) if enrolled else None,
            "simulator_start_rate_per_s": SIM_START_RATE,
            "counts": counts,
        }
        result["connect"] = connect
        log(
            f"{count}: all synced {connect['total_s']:.1f} s after the simulator started "
            f"(enrolment {connect['enrolment_s']:.1f} s, then {connect['after_enrolment_s']:.1f} s to connect)"
        )

        time.sleep(5)
        serve_rss = rss_settled(serve.process.pid)
        result["serve_rss_connected_mb"] = serve_rss
        result["serve_rss_per_agent_kb"] = (serve_rss - result["serve_rss_idle_mb"]) * 1024 / count
        result["simulator_rss_mb"] = vm_rss_mb(sim.pid)
        log(
            f"{count}: serve RSS {serve_rss:.1f} MB connected, "
            f"{result['serve_rss_per_agent_kb']:.0f} KiB per agent; simulator {result['simulator_rss_mb']:.0f} MB"
        )

        profile = Profile(py_spy, serve.process.pid, (profile_dir or work) / f"serve-{count}-mode-change.txt")
        meter = CpuMeter(serve.process.pid, sim.pid)
        try:
            changed = time.monotonic()
            intent = post("/mode-changes", {"selection": {"all": True}, "mode": "simulation"})
            post_s = time.monotonic() - changed
            converged, counts = wait_synced("mode change", 300)
        finally:
            profile.stop()
        cpu = meter.stop()
        converge_s = converged - changed
        walk_started = time.monotonic()
        items, cursor, mismatched, wrong_mode = 0, None, [], 0
        while True:
            page = get("/workloads?limit=500" + (f"&cursor={cursor}" if cursor else ""))
            for item in page["items"]:
                items += 1
                if item["applied_version"] != item["latest_version"] or item["sync"]["state"] != "synced":
                    mismatched.append(item["id"])
                if item["mode"] != "simulation":
                    wrong_mode += 1
            cursor = page.get("next_cursor")
            if not cursor:
                break
            left(1)
        walk_s = time.monotonic() - walk_started
        result["mode_change"] = {
            "post_s": post_s,
            "until_all_applied_s": converge_s,
            "changed_count": intent.get("changed_count"),
            "walk": {
                "items": items,
                "applied_differs_from_latest": len(mismatched),
                "wrong_mode": wrong_mode,
                "seconds": walk_s,
            },
            "cpu": cpu,
            "target_s": MODE_CHANGE_TARGET_S,
            "met": converge_s <= MODE_CHANGE_TARGET_S
            and not mismatched
            and items == count
            and not wrong_mode,
        }
        result["serve_rss_after_mode_change_mb"] = rss_settled(serve.process.pid, 2)
        log(
            f"{count}: mode change of {intent.get('changed_count')} to simulation: POST {post_s:.2f} s, "
            f"all applied == latest after {converge_s:.2f} s [target <= {MODE_CHANGE_TARGET_S:.0f} s: "
            f"{'met' if result['mode_change']['met'] else 'MISSED'}]; walk of {items}: "
            f"{len(mismatched)} with applied != latest, {wrong_mode} not in simulation; CPU s in "
            f"{cpu['wall_s']:.1f} s: "
            + ", ".join(f"{name} {seconds:.1f}" for name, seconds in cpu["cpu_s"].items())
        )
    except Timeout as error:
        result["error"] = str(error)
        log(f"{count}: {error}")
        if sim_lines is not None:
            result["simulator_last_summaries"] = [
                line.strip() for _, line in sim_lines.lines if "[fleet] fleet " in line
            ][-5:]
            log("simulator: " + (result["simulator_last_summaries"] or ["(no summary)"])[-1])
    finally:
        if http is not None:
            http.close()
        if sim is not None:
            terminate(sim, 60)
        if serve is not None and serve.process is not None:
            try:
                result["serve_exit"] = serve.stop(timeout=60)
            except AssertionError:
                serve.kill()
            warnings = [
                line
                for line in serve.stderr_text().splitlines()
                if re.search(r"WARNING|ERROR|Traceback", line)
            ]
            result["serve_warning_lines"] = len(warnings)
            result["serve_warnings_first"] = [line.strip()[:300] for line in warnings[:10]]
            closes = Counter(
                re.sub(r"[0-9a-f-]{36}|sim-\d+|\d+\.\d+\.\d+\.\d+", "*", m.group(0))
                for m in re.finditer(r"closing stream of .*|stream of \S+ ended \(\d+\)", serve.stderr_text())
            )
            result["serve_stream_closes"] = dict(closes.most_common(10))
        try:
            database(db_name, create=False)
        except Exception as error:  # noqa: BLE001 - report, keep cleaning
            log(f"could not drop database {db_name}: {error}")
        shutil.rmtree(work, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--counts", default="2000,5000", help="comma-separated agent counts (default 2000,5000)"
    )
    parser.add_argument("--poll", type=float, default=0.25, help="seconds between GET /workloads/counts")
    parser.add_argument("--budget", type=float, default=1200, help="seconds allowed per count")
    parser.add_argument("--py-spy", metavar="PATH", help="a py-spy binary: sample serve during each phase")
    parser.add_argument(
        "--profile-dir", type=Path, default=Path(tempfile.gettempdir()) / "palisade-bench-profiles"
    )
    args = parser.parse_args()
    exit_on_sigterm()
    os.environ.pop("REDIS_URL", None)  # one serve process: the in-memory channel layer

    source = source_state()
    runs = [
        run_count(int(c), args.poll, args.budget, args.py_spy, args.profile_dir)
        for c in args.counts.split(",")
    ]
    results = {
        "runs": runs,
        "source": {"at_start": source, "at_end": source_state()},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
    }
    print()
    for run in runs:
        if "mode_change" not in run:
            print(f"{run['agents']} agents: incomplete ({run.get('error')})")
            continue
        connect, change = run["connect"], run["mode_change"]
        print(
            f"{run['agents']} agents: connected in {connect['total_s']:.1f} s (enrolment {connect['enrolment_s']:.1f} s); "
            f"serve RSS {run['serve_rss_idle_mb']:.0f} MB idle, {run['serve_rss_connected_mb']:.0f} MB connected = "
            f"{run['serve_rss_per_agent_kb']:.0f} KiB per agent; mode change to simulation applied everywhere in "
            f"{change['until_all_applied_s']:.1f} s (POST {change['post_s']:.1f} s) "
            f"[target <= {MODE_CHANGE_TARGET_S:.0f} s: {'met' if change['met'] else 'MISSED'}]"
        )
    results_write("fleet_scale", results)


if __name__ == "__main__":
    main()

"""Thousands of simulated agents on one or two `serve` processes: connect, mode change, memory, failover.

    .venv/bin/python bench/bench_fleet_scale.py [--counts 2000,5000] [--poll 0.25]
    .venv/bin/python bench/bench_fleet_scale.py --serves 2 --redis redis://127.0.0.1:6379/5 \
        --counts 10000 [--simulators 2]

For each count, from nothing:

1. A throwaway PostgreSQL database (palisade_bench_scale_<pid>_<count> on BENCH_PG_ADMIN_URL's server,
   default postgresql://postgres@127.0.0.1:5432/postgres) and a temporary data directory; the real
   `manage.py serve` on 127.0.0.1 (tests/support/serve_process.py). One process: the in-memory channel
   layer (no REDIS_URL). With --serves 2: two processes on one data directory (so both present its
   gateway certificate), that database and the Redis of --redis, each given both gateways with
   `--gateway-advertise` in the same order, as docs/operations.md deploys them. Each one's RSS idle is
   read once it answers the API. The bench raises its soft RLIMIT_NOFILE to the hard limit (serve and
   the simulators inherit it): a held stream is a descriptor on both sides.
2. A provisioning token with max_uses = count (its bundle lists every gateway), and
   `python -m agent simulate` as --simulators separate processes on loopback, each with its own range
   of agent numbers (real agent code, RecordingDataplane, no kernel), their state directories in
   /dev/shm where it exists (each agent rewrites its status file at every event: on a busy disk that
   stalled the simulators' event loops). Times: until every simulator has
   enrolled its agents (the last `enrolled` line), and until GET /workloads/counts shows all N synced.
   Each simulator starts --start-rate agents a second (default 200), so connecting N takes at least
   N / (rate x simulators) s by design. An agent streams to the first gateway of its list that answers,
   so with two processes the first holds the streams (an agent whose handshake with it times out goes
   on to the second: under load a third of them did).
3. Each serve's RSS with the agents connected and idle; per held stream = (RSS connected - RSS idle) /
   the streams it holds (the database's fleet_workload.stream_gateway). Target: <= 100 KiB. The
   simulators' RSS, and the CPU of serve, the simulators, PostgreSQL (and Redis) in each phase.
4. POST /mode-changes {"selection": {"all": true}, "mode": "simulation"} (with two processes, to the
   one holding fewer streams: the change reaches the others through Redis): time until every workload has
   applied its latest version (polling counts until synced == N), then a full walk of
   GET /workloads?limit=500 checks applied == latest and the mode on every item.
   Target: <= 10 s on one process; <= 30 s on two (issue 36).
5. Two processes: SIGKILL the one holding the most streams; time until every workload streams on the
   other (stream_gateway in the database), target <= 30 s; then at once POST /mode-changes back to
   "visibility" to the survivor, and time until every workload streams on it in that mode with its
   latest version applied. The survivor's RSS is then read per stream as well.

With --floor, the fixed stack's floor is measured in the same run, just before the first count:
bench/bench_stock_floor.py's `ws-auth` (daphne over TLS answering the agent's own connect path and the
protocol's least authentication, no Palisade code) for as many connections as the largest count, from
--simulators client processes; the failover's CPU a reconnect (serve, simulators) is then printed
over the floor's (server, clients): how much of a reconnect is the stack's and how much Palisade's.

With --py-spy PATH (py-spy installed anywhere, e.g. `pip install --target /tmp/x py-spy`), serve (the
first; after a kill, the survivor) is sampled during the connect phase, the held idle fleet, the
mode change and the failover (`py-spy record --format raw --threads --idle`, collapsed stacks per
thread, waiting included; BENCH_PY_SPY_FLAGS replaces `--idle`, "" samples busy threads only) into
--profile-dir.

Everything is bounded in time; the simulators, serve, the database and temporary directories are
removed even on failure. Results: bench/results/fleet_scale.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
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

from benchlib import cpu_seconds, exit_on_sigterm, results_write  # noqa: E402

from agent.simulated import SUMMARY_SECONDS  # noqa: E402
from tests.support.serve_process import ServeProcess, free_port, terminate  # noqa: E402

ADMIN_URL = os.environ.get("BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
MODE_CHANGE_TARGET_S = 10.0  # one process
TWO_SERVES_TARGET_S = 30.0  # issue 36: the mode change, and the failover, on two processes
FAILOVER_TARGET_S = 30.0
IDLE_SECONDS = 20.0  # holding the fleet idle: heartbeats (15 s) and pings (20 s) come around once
STREAM_MEMORY_TARGET_KB = 100
# A summary's states and its collector's time, not tallies of attempts.
STATE_KEYS = {
    "agents",
    "applied",
    "connected",
    "connecting",
    "disconnected",
    "gc_ms",
    "gc_full",
    "gc_full_ms",
}

_t0 = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _t0:6.1f}s] {message}", flush=True)


def vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def named_cpu_seconds(*names: str) -> float:
    """CPU time of every process on this machine with one of these command names, and of their exited
    children: PostgreSQL's backends come and go (those of a killed serve all at once), and the
    postmaster reaps them, so their time stays counted (other users of the same server are counted)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as handle:
                    if handle.read().strip() in names:
                        total += cpu_seconds(int(entry), reaped=True)
            except OSError:
                continue
    return total


class CpuMeter:
    """Where the CPU time of a phase went: serve, the simulators, PostgreSQL, Redis; on a 2-core
    machine they share two cores, so this says which one a faster phase must take work from."""

    def __init__(self, pids: dict[str, list[int]], redis: bool = False) -> None:
        self.pids = pids  # name -> processes counted together under it
        self.redis = redis
        self.started = time.monotonic()
        self.before = self._read()

    def _read(self) -> dict:
        used = {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in self.pids.items()}
        used["postgres"] = named_cpu_seconds("postgres", "postmaster")
        if self.redis:
            used["redis"] = named_cpu_seconds("redis-server")
        return used

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


class FleetRows:
    """What the database says about every workload's stream: which gateway holds it, and whether it
    applied its latest version in a mode (two processes: the API of either sees the same rows, but a
    killed process leaves its rows naming it until the agent streams again elsewhere)."""

    def __init__(self, database_url: str) -> None:
        import psycopg

        self.db = psycopg.connect(database_url, autocommit=True)

    def streams(self) -> Counter:
        rows = self.db.execute(
            "SELECT stream_gateway, count(*) FROM fleet_workload WHERE stream_id <> '' GROUP BY 1"
        ).fetchall()
        return Counter(dict(rows))

    def converged(self, mode: str, gateway: str) -> int:
        return self.db.execute(
            "SELECT count(*) FROM fleet_workload WHERE stream_id <> '' AND stream_gateway = %s "
            "AND mode = %s AND sync_state = 'synced' AND applied_version = latest_policy_id",
            (gateway, mode),
        ).fetchone()[0]

    def close(self) -> None:
        self.db.close()


class Simulators:
    """`python -m agent simulate` as several processes, each with agent numbers of its own."""

    def __init__(
        self,
        bundle_file: Path,
        count: int,
        processes: int,
        state_root: Path,
        start_rate: float,
        open_seconds: float = 10.0,
    ) -> None:
        self.processes: list[subprocess.Popen] = []
        self.lines: list[Lines] = []
        share, extra = divmod(count, processes)
        first = 1
        for i in range(processes):
            n = share + (1 if i < extra else 0)
            process = subprocess.Popen(
                [sys.executable, "-m", "agent", "simulate", "--bundle-file", str(bundle_file),
                 "--count", str(n), "--first-index", str(first), "--state-root", str(state_root),
                 "--start-rate", str(start_rate), "--open-seconds", str(open_seconds)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, start_new_session=True,
            )  # fmt: skip
            self.processes.append(process)
            self.lines.append(Lines(process.stderr))
            first += n

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def check(self) -> None:
        for process, lines in zip(self.processes, self.lines, strict=True):
            if process.poll() is not None:
                raise RuntimeError(f"a simulator exited {process.returncode}:\n{lines.tail()}")

    def all_enrolled_at(self) -> float | None:
        times = [lines.first(r" enrolled agents=") for lines in self.lines]
        return None if None in times else max(at for at, _ in times)

    def rss_mb(self) -> float:
        return sum(vm_rss_mb(pid) for pid in self.pids)

    def last_summaries(self) -> list[str]:
        return [
            ([line.strip() for _, line in lines.lines if "[fleet] fleet " in line] or ["(no summary)"])[-1]
            for lines in self.lines
        ]

    def tally(self) -> Counter:
        """The fleets' counts summed from their last summaries (each at most SUMMARY_SECONDS old)."""
        total: Counter = Counter()
        for line in self.last_summaries():
            total.update({key: int(n) for key, n in re.findall(r"(\w+)=(\d+)\b", line)})
        return total

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            terminate(process, 60)


def serves_start(
    work: Path, db_url: str, serves: int, redis: str | None, timeout: float
) -> list[ServeProcess]:
    common = ["--max-connections-per-address", "0"]  # every simulated agent connects from 127.0.0.1
    if serves == 1:
        return [ServeProcess(work / "data", common, database_url=db_url).start(timeout=timeout)]
    gateways = [f"127.0.0.1:{port}" for port in distinct_free_ports(2 * serves)[:serves]]
    advertise = [arg for gateway in gateways for arg in ("--gateway-advertise", gateway)]
    processes = []
    for gateway in gateways:
        # One data directory: every process presents its gateway certificate (docs/operations.md).
        # The first starts alone: it makes the certificate and migrates the database.
        process = ServeProcess(
            work / "data", [*advertise, *common], database_url=db_url, gateway_listen=gateway,
            env={"REDIS_URL": redis},
        )  # fmt: skip
        processes.append(process.start(timeout=timeout))
    return processes


def distinct_free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def raise_open_file_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard one, for this process and the serves and simulators it starts."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def run_count(
    count: int,
    poll: float,
    budget: float,
    *,
    serves: int = 1,
    redis: str | None = None,
    simulators: int = 1,
    start_rate: float = 200.0,
    open_seconds: float = 10.0,
    py_spy: str | None = None,
    profile_dir: Path | None = None,
) -> dict:
    deadline = time.monotonic() + budget
    mode_change_target = MODE_CHANGE_TARGET_S if serves == 1 else TWO_SERVES_TARGET_S

    def left(cap: float) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Timeout(f"the {count}-agent run ran out of its {budget:.0f} s")
        return min(cap, remaining)

    db_name = f"palisade_bench_scale_{os.getpid()}_{count}"
    work = Path(tempfile.mkdtemp(prefix=f"palisade-bench-scale-{count}-"))
    # The simulated agents' state directories in memory where there is a tmpfs: each agent writes its
    # status file at every event, and a fleet's files on a busy disk stalled the simulator's event
    # loop (10,000 agents: handshakes timed out by the thousand and no stream got through).
    agents_root = Path(tempfile.mkdtemp(prefix=f"palisade-bench-agents-{count}-", dir=agents_dir()))
    procs: list[ServeProcess] = []
    sims: Simulators | None = None
    rows: FleetRows | None = None
    https: list = []
    result: dict = {"agents": count, "serves": serves, "simulators": simulators, "redis": bool(redis)}
    profiles = profile_dir or work

    try:
        db_url = database(db_name, create=True)
        procs = serves_start(work, db_url, serves, redis, left(180))
        rows = FleetRows(db_url)
        token = procs[0].mint_operator_token("bench-scale")
        for process in procs:
            http = process.client("operator", headers={"Authorization": f"Bearer {token}"})
            http.timeout = 120
            https.append(http)
        name = {process.gateway_listen: f"serve-{i + 1}" for i, process in enumerate(procs)}

        def get(path: str, i: int = 0) -> dict:
            response = https[i].get("/api/v1" + path)
            if response.status_code != 200:
                raise RuntimeError(f"GET {path}: {response.status_code} {response.text[:500]}")
            return response.json()

        def post(path: str, body: dict, i: int = 0) -> dict:
            response = https[i].post("/api/v1" + path, json=body)
            if response.status_code not in (200, 201, 202):
                raise RuntimeError(f"POST {path}: {response.status_code} {response.text[:500]}")
            return response.json()

        def wait_until(what: str, cap: float, done, describe) -> float:
            started = time.monotonic()
            end = started + left(cap)
            while time.monotonic() < end:
                if done():
                    return time.monotonic()
                sims.check()
                time.sleep(poll)
            raise Timeout(f"{what}: not within {cap:.0f} s; last {describe()}")

        def refused() -> dict:
            # Streams each live process refused at admission so far (4503 with a retry-after).
            counts = {}
            for i, process in enumerate(procs):
                if process.process is None or process.process.poll() is not None:
                    continue
                text = https[i].get("/metrics", headers={"Accept": "text/plain"}).text
                found = re.search(r"^palisade_stream_admissions_refused_total (\S+)$", text, re.M)
                counts[name[process.gateway_listen]] = int(float(found[1])) if found else None
                # Unfinished handshakes closed at the gateway listener's bound for newer ones, and new
                # connections refused there while the unfinished all progressed.
                for what in ("closed", "refused"):
                    found = re.search(
                        rf'^palisade_handshakes_{what}_total{{listener="gateway"}} (\S+)$', text, re.M
                    )
                    counts[f"{name[process.gateway_listen]} handshakes {what}"] = (
                        int(float(found[1])) if found else 0
                    )
            return counts

        def gc_seconds(i: int) -> list[float]:
            # serve's cyclic collector time by generation (palisade_gc_seconds_total).
            text = https[i].get("/metrics", headers={"Accept": "text/plain"}).text
            return [
                float(re.search(rf'^palisade_gc_seconds_total{{generation="{g}"}} (\S+)$', text, re.M)[1])
                for g in (0, 1, 2)
            ]

        def all_synced(i: int = 0) -> bool:
            counts = get("/workloads/counts", i)
            return counts["sync_state"]["synced"] == count and counts["total"] == count

        for i in range(len(procs)):
            for _ in range(3):
                get("/workloads/counts", i)
        bundle = post("/provisioning-tokens", {"description": f"bench scale {count}", "max_uses": count})[
            "bundle"
        ]
        time.sleep(2)
        idle = [rss_settled(process.process.pid) for process in procs]
        result["serve_rss_idle_mb"] = idle
        log(f"{count}: serve idle RSS " + ", ".join(f"{mb:.1f} MB" for mb in idle))

        bundle_file = work / "bundle.txt"
        bundle_file.write_text(bundle)
        started = time.monotonic()
        sims = Simulators(bundle_file, count, simulators, agents_root, start_rate, open_seconds)
        meter = CpuMeter({"serve": [p.process.pid for p in procs], "simulators": sims.pids}, bool(redis))
        profile = Profile(py_spy, procs[0].process.pid, profiles / f"serve-{count}-connect.txt")
        enrolled: dict = {}
        progress = {"at": time.monotonic(), "log": []}
        result["connect_progress"] = progress["log"]  # kept when the connect does not finish

        def connected_all() -> bool:
            # Once every agent is enrolled, serve's memory and the streams held: what streams add
            # from here on is told apart from what the enrolments left behind.
            if not enrolled and sims.all_enrolled_at() is not None:
                enrolled["rss_mb"] = [vm_rss_mb(p.process.pid) for p in procs]
                enrolled["streams"] = rows.streams()
            if enrolled and time.monotonic() - progress["at"] >= 15:
                # Every 15 s once enrolled: how the streams build up, and what the bounds turned away.
                progress["at"] = time.monotonic()
                streams = {name.get(g, g): n for g, n in rows.streams().items()}
                kernel = {
                    name[p.gateway_listen]: sockets_on(int(p.gateway_listen.rsplit(":", 1)[1])) for p in procs
                }
                turned = refused()
                progress["log"].append(
                    {
                        "s": round(time.monotonic() - started, 1),
                        "streams": streams,
                        "refused": turned,
                        "sockets": kernel,
                        "load": os.getloadavg()[0],
                    }
                )
                log(f"{count}: streams {streams}; refused {turned}; sockets {kernel}; load {load()}")
            return all_synced()

        try:
            all_synced_at = wait_until(
                "connect", 120 + count * 0.4, connected_all, lambda: get("/workloads/counts")
            )
        finally:
            profile.stop()
        enrolled_at = sims.all_enrolled_at()
        connect = {
            "total_s": all_synced_at - started,
            "enrolment_s": (enrolled_at - started) if enrolled_at else None,
            "after_enrolment_s": (all_synced_at - enrolled_at) if enrolled_at else None,
            "simulator_start_rate_per_s": start_rate * simulators,
            "simulator_open_seconds": open_seconds,
            "progress": progress["log"],
            "counts": get("/workloads/counts"),
            "streams": {name.get(g, g): n for g, n in rows.streams().items()},
            "cpu": meter.stop(),
            "admission_refused": refused(),
        }
        result["connect"] = connect
        log(
            f"{count}: all synced {connect['total_s']:.1f} s after the simulators started "
            f"(enrolment {connect['enrolment_s']:.1f} s, then {connect['after_enrolment_s']:.1f} s to connect); "
            f"streams {connect['streams']}; refused at admission {connect['admission_refused']}; CPU s: "
            + cpu_text(connect["cpu"])
            + f"; load {load()}"
        )

        time.sleep(5)
        streams = rows.streams()
        connected = [rss_settled(process.process.pid) for process in procs]
        result["serve_rss_connected_mb"] = connected
        per_stream = {
            name[p.gateway_listen]: round((mb - was) * 1024 / streams[p.gateway_listen], 1)
            for p, mb, was in zip(procs, connected, idle, strict=True)
            if streams.get(p.gateway_listen)
        }
        result["serve_rss_per_stream_kb"] = per_stream
        # The same, from serve's RSS once every agent had enrolled: the streams alone.
        result["serve_rss_enrolled_mb"] = enrolled.get("rss_mb")
        marginal = {
            name[p.gateway_listen]: round(
                (mb - was)
                * 1024
                / (streams[p.gateway_listen] - enrolled["streams"].get(p.gateway_listen, 0)),
                1,
            )
            for p, mb, was in zip(procs, connected, enrolled.get("rss_mb", []), strict=False)
            if streams.get(p.gateway_listen, 0) - enrolled["streams"].get(p.gateway_listen, 0) > count / 10
        }
        result["serve_rss_per_stream_after_enrolment_kb"] = marginal
        result["serve_rss_per_agent_kb"] = (sum(connected) - sum(idle)) * 1024 / count
        result["simulator_rss_mb"] = sims.rss_mb()
        result["simulator_state"] = {"dir": str(agents_root), "mb": round(tree_mb(agents_root), 1)}
        profile = Profile(py_spy, procs[0].process.pid, profiles / f"serve-{count}-held-idle.txt")
        meter = CpuMeter({"serve": [p.process.pid for p in procs], "simulators": sims.pids}, bool(redis))
        try:
            time.sleep(IDLE_SECONDS)
        finally:
            profile.stop()
        result["held_idle_cpu"] = meter.stop()
        log(
            f"{count}: serve RSS " + ", ".join(f"{mb:.1f}" for mb in connected) + " MB connected; "
            f"per held stream {per_stream} KiB [target <= {STREAM_MEMORY_TARGET_KB} KiB], {marginal} KiB "
            f"counted from the RSS once all had enrolled; simulators "
            f"{result['simulator_rss_mb']:.0f} MB RSS in all (state files {result['simulator_state']['mb']:.0f} MB); CPU s holding them idle: "
            + cpu_text(result["held_idle_cpu"])
        )

        # With two processes, the change goes to the one without streams: it reaches them through Redis.
        by = min(range(len(procs)), key=lambda i: streams.get(procs[i].gateway_listen, 0))
        profile = Profile(py_spy, procs[0].process.pid, profiles / f"serve-{count}-mode-change.txt")
        meter = CpuMeter({"serve": [p.process.pid for p in procs], "simulators": sims.pids}, bool(redis))
        try:
            changed = time.monotonic()
            intent = post("/mode-changes", {"selection": {"all": True}, "mode": "simulation"}, by)
            post_s = time.monotonic() - changed
            converged = wait_until("mode change", 300, all_synced, lambda: get("/workloads/counts"))
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
            "posted_to": name[procs[by].gateway_listen],
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
            "load": load(),
            "target_s": mode_change_target,
            "met": converge_s <= mode_change_target and not mismatched and items == count and not wrong_mode,
        }
        result["serve_rss_after_mode_change_mb"] = [rss_settled(p.process.pid, 2) for p in procs]
        log(
            f"{count}: mode change of {intent.get('changed_count')} to simulation: POST {post_s:.2f} s, "
            f"all applied == latest after {converge_s:.2f} s [target <= {mode_change_target:.0f} s: "
            f"{'met' if result['mode_change']['met'] else 'MISSED'}]; walk of {items}: "
            f"{len(mismatched)} with applied != latest, {wrong_mode} not in simulation; CPU s "
            + cpu_text(cpu)
            + f"; load {result['mode_change']['load']}"
        )
        if serves > 1:
            result["failover"] = failover(
                procs, name, rows, sims, post, wait_until, count, idle, py_spy, profiles, gc_seconds
            )
            result["failover"]["admission_refused_since_start"] = refused()
            log(
                f"{count}: refused at admission since the start: {result['failover']['admission_refused_since_start']}"
            )
    except Timeout as error:
        result["error"] = str(error)
        log(f"{count}: {error}")
        if sims is not None:
            result["simulator_last_summaries"] = sims.last_summaries()
            for line in result["simulator_last_summaries"]:
                log("simulator: " + line)
    finally:
        for http in https:
            http.close()
        if rows is not None:
            rows.close()
        if sims is not None:
            sims.stop()
        result["serve_exit"], result["serve_warning_lines"], result["serve_warnings_first"] = [], 0, []
        closes: Counter = Counter()
        for process in procs:
            if process.process is None:
                continue
            try:
                result["serve_exit"].append(process.stop(timeout=60))
            except AssertionError:
                process.kill()
            warnings = [
                line
                for line in process.stderr_text().splitlines()
                if re.search(r"WARNING|ERROR|Traceback", line)
            ]
            result["serve_warning_lines"] += len(warnings)
            result["serve_warnings_first"] += [line.strip()[:300] for line in warnings[:10]]
            closes += Counter(
                re.sub(r"[0-9a-f-]{36}|sim-\d+|\d+\.\d+\.\d+\.\d+(:\d+)?", "*", m.group(0))
                for m in re.finditer(
                    r"closing stream of .*|stream of \S+ ended \(\d+\)", process.stderr_text()
                )
            )
        result["serve_stream_closes"] = dict(closes.most_common(10))
        try:
            database(db_name, create=False)
        except Exception as error:  # noqa: BLE001 - report, keep cleaning
            log(f"could not drop database {db_name}: {error}")
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(agents_root, ignore_errors=True)
    return result


def tree_mb(root: Path) -> float:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file()) / 2**20


def agents_dir() -> str | None:
    shm = Path("/dev/shm")  # noqa: S108 - mkdtemp makes a private directory inside it
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def failover(procs, name, rows, sims, post, wait_until, count, idle, py_spy, profiles, gc_seconds) -> dict:
    """SIGKILL the process holding the most streams; every agent streams again on the other, and a
    mode change made at once reaches all of them there."""
    streams = rows.streams()
    doomed = max(range(len(procs)), key=lambda i: streams.get(procs[i].gateway_listen, 0))
    (survivor,) = [i for i in range(len(procs)) if i != doomed]
    gateway = procs[survivor].gateway_listen
    meter = CpuMeter({"serve": [procs[survivor].process.pid], "simulators": sims.pids}, True)
    profile = Profile(py_spy, procs[survivor].process.pid, profiles / f"serve-{count}-failover.txt")
    # The simulators reconnect as many agents as serve takes: their share of the two cores counts too.
    simulator = Profile(py_spy, sims.pids[0], profiles / f"simulator-{count}-failover.txt")
    tally_before = sims.tally()
    survivor_gc_before = gc_seconds(survivor)
    try:
        killed = time.monotonic()  # stop() returns once the process is reaped and its output read
        procs[doomed].stop(signal.SIGKILL, timeout=30)
        progress: list[tuple[float, int]] = []  # (seconds after the kill, streams on the survivor)

        def all_moved() -> bool:
            now = rows.streams()
            if not progress or time.monotonic() - killed - progress[-1][0] >= 5:
                progress.append((round(time.monotonic() - killed, 1), now.get(gateway, 0)))
            return now == {gateway: count}

        try:
            moved = wait_until(
                "every agent streaming on the survivor", max(120, count * 0.06), all_moved, rows.streams
            )
        except Timeout as error:
            raise Timeout(
                f"{error}; streams on the survivor (s after the kill, streams): {progress}"
            ) from None
    finally:
        profile.stop()
        simulator.stop()
    cpu = meter.stop()
    survivor_gc = [
        round(after - before, 2)
        for before, after in zip(survivor_gc_before, gc_seconds(survivor), strict=True)
    ]
    failover_s = moved - killed
    meter = CpuMeter({"serve": [procs[survivor].process.pid], "simulators": sims.pids}, True)
    changed = time.monotonic()
    intent = post("/mode-changes", {"selection": {"all": True}, "mode": "visibility"}, survivor)
    converged = wait_until(
        "the mode change after failover",
        300,
        lambda: rows.converged("visibility", gateway) == count,
        lambda: f"{rows.converged('visibility', gateway)} of {count} converged",
    )
    change_cpu = meter.stop()
    time.sleep(SUMMARY_SECONDS)  # the simulators' next summaries count the whole failover
    during = sims.tally() - tally_before
    attempts = {key: n for key, n in during.items() if key not in STATE_KEYS}
    collector = {key: during[key] for key in ("gc_ms", "gc_full", "gc_full_ms")}
    rss = rss_settled(procs[survivor].process.pid)
    out = {
        "killed": name[procs[doomed].gateway_listen],
        "streams_before": {name.get(g, g): n for g, n in streams.items()},
        "all_streaming_on_survivor_s": failover_s,
        "target_s": FAILOVER_TARGET_S,
        "met": failover_s <= FAILOVER_TARGET_S,
        "progress": progress,
        "reached_s": {
            f"{share:.0%}": next((at for at, n in progress if n >= share * count), round(failover_s, 1))
            for share in (0.5, 0.9, 0.99)
        },
        "cpu": cpu,
        "load": load(),
        "mode_change_after": {
            "changed_count": intent.get("changed_count"),
            "until_all_applied_s": converged - changed,
            "cpu": change_cpu,
        },
        "survivor_rss_mb": rss,
        "agent_attempts": attempts,
        "simulators_collector": collector,
        "survivor_gc_s_by_generation": survivor_gc,
        "survivor_rss_per_stream_kb": round((rss - idle[survivor]) * 1024 / count, 1),
    }
    out["cpu_ms_per_reconnect"] = {
        name: round(seconds / count * 1000, 2) for name, seconds in cpu["cpu_s"].items()
    }
    log(
        f"{count}: SIGKILL {out['killed']}: all {count} streaming on {name[gateway]} after "
        f"{failover_s:.1f} s [target <= {FAILOVER_TARGET_S:.0f} s: {'met' if out['met'] else 'MISSED'}] "
        f"(share of the fleet there by s after the kill: {out['reached_s']}); "
        f"CPU s: {cpu_text(cpu)}; load {out['load']}; a mode change then applied everywhere in "
        f"{converged - changed:.1f} s (CPU s: {cpu_text(change_cpu)}); survivor RSS {rss:.0f} MB = "
        f"{out['survivor_rss_per_stream_kb']:.0f} KiB per stream; the agents' attempts to reach a gateway "
        f"meanwhile: {attempts}; the simulators' cyclic collector meanwhile: {collector['gc_ms']} ms in all, "
        f"{collector['gc_full']} full collections ({collector['gc_full_ms']} ms); the survivor's in the failover, by generation "
        f"(s): {survivor_gc}"
    )
    return out


def sockets_on(port: int) -> dict:
    """The kernel's view of one listener: connections waiting in its accept queue, and established
    connections to it (accepted or not)."""
    try:
        listening = subprocess.run(
            ["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, timeout=10
        ).stdout.split()
        established = subprocess.run(
            ["ss", "-Htn", "state", "established", f"sport = :{port}"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.count("\n")
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {"accept_queue": int(listening[1]) if len(listening) > 1 else None, "established": established}


def cpu_text(cpu: dict) -> str:
    return f"in {cpu['wall_s']:.1f} s " + ", ".join(f"{name} {s:.1f}" for name, s in cpu["cpu_s"].items())


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def stream_floor(connections: int, clients: int) -> dict:
    """bench_stock_floor.py's `ws-auth`: the fixed stack's CPU for a stream, with no Palisade code."""
    sys.path.insert(0, str(REPO / "bench"))
    from bench_stock_floor import FLOW_THREADS, measure

    args = argparse.Namespace(
        connections=connections, clients=clients, concurrency=200, idle=5.0, flow_threads=FLOW_THREADS
    )
    log(f"the stack's floor: {connections} authenticated streams on a stock daphne ...")
    with tempfile.TemporaryDirectory(prefix="palisade-floor-") as tmp:
        (Path(tmp) / "ws-auth").mkdir()
        floor = measure("ws-auth", args, Path(tmp))
    log(
        f"the stack's floor: server {floor['server_cpu_ms']} ms, clients {floor['client_cpu_ms']} ms of CPU a "
        f"stream, {floor['per_second']}/s, {floor['failures']} failed; load {load()}"
    )
    return floor


def over_floor(reconnect: dict, floor: dict) -> str:
    """The failover's CPU a reconnect over the floor's, side by side."""
    serve, sims = reconnect["serve"], reconnect["simulators"]
    both = serve + sims
    return (
        f"CPU a reconnect over the stack's floor (same run): serve {serve:.2f} / {floor['server_cpu_ms']:.2f} ms "
        f"= {serve / floor['server_cpu_ms']:.2f}x, simulators {sims:.2f} / {floor['client_cpu_ms']:.2f} ms "
        f"= {sims / floor['client_cpu_ms']:.2f}x, both {both:.2f} / {floor['both_cpu_ms']:.2f} ms "
        f"= {both / floor['both_cpu_ms']:.2f}x (PostgreSQL {reconnect.get('postgres', 0):.2f} ms more)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--counts", default="2000,5000", help="comma-separated agent counts (default 2000,5000)"
    )
    parser.add_argument("--poll", type=float, default=0.25, help="seconds between polls of the fleet")
    parser.add_argument("--budget", type=float, default=1200, help="seconds allowed per count")
    parser.add_argument(
        "--serves", type=int, choices=(1, 2), default=1, help="serve processes (2 needs --redis; default 1)"
    )
    parser.add_argument("--redis", metavar="URL", help="the Redis two serve processes share (redis://...)")
    parser.add_argument(
        "--simulators", type=int, default=1, help="simulator processes sharing the agents (default 1)"
    )
    parser.add_argument(
        "--start-rate",
        type=float,
        default=200.0,
        help="agents each simulator starts per second once all are enrolled (default 200)",
    )
    parser.add_argument(
        "--open-seconds",
        type=float,
        default=10.0,
        help="each simulated agent's time for TLS and the upgrade (default 10, the real agent's)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="measure the stock stack's stream floor first (bench_stock_floor.py ws-auth) as the baseline",
    )
    parser.add_argument("--py-spy", metavar="PATH", help="a py-spy binary: sample serve during each phase")
    parser.add_argument(
        "--profile-dir", type=Path, default=Path(tempfile.gettempdir()) / "palisade-bench-profiles"
    )
    args = parser.parse_args()
    if args.serves > 1 and not args.redis:
        parser.error("--serves 2 needs --redis URL: the processes share it")
    if args.simulators < 1:
        parser.error("--simulators must be at least 1")
    if args.start_rate <= 0:
        parser.error("--start-rate must be positive")
    exit_on_sigterm()
    os.environ.pop("REDIS_URL", None)  # one serve process: the in-memory channel layer
    nofile = raise_open_file_limit()

    source = source_state()
    floor = stream_floor(max(int(c) for c in args.counts.split(",")), args.simulators) if args.floor else None
    runs = [
        run_count(
            int(c),
            args.poll,
            args.budget,
            serves=args.serves,
            redis=args.redis if args.serves > 1 else None,
            simulators=args.simulators,
            start_rate=args.start_rate,
            open_seconds=args.open_seconds,
            py_spy=args.py_spy,
            profile_dir=args.profile_dir,
        )  # fmt: skip
        for c in args.counts.split(",")
    ]
    results = {
        "runs": runs,
        "floor": floor,
        "source": {"at_start": source, "at_end": source_state()},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "open_file_limit": nofile,
        },
    }
    print()
    for run in runs:
        if "mode_change" not in run:
            print(f"{run['agents']} agents: incomplete ({run.get('error')})")
            continue
        connect, change = run["connect"], run["mode_change"]
        print(
            f"{run['agents']} agents on {run['serves']} serve(s), {run['simulators']} simulator(s): connected in "
            f"{connect['total_s']:.1f} s (enrolment {connect['enrolment_s']:.1f} s); serve RSS per held stream "
            f"{run['serve_rss_per_stream_kb']} KiB [target <= {STREAM_MEMORY_TARGET_KB}: "
            f"{'met' if max(run['serve_rss_per_stream_kb'].values()) <= STREAM_MEMORY_TARGET_KB else 'MISSED'}]; "
            f"simulators {run['simulator_rss_mb']:.0f} MB RSS; mode change applied everywhere in "
            f"{change['until_all_applied_s']:.1f} s (POST {change['post_s']:.1f} s) "
            f"[target <= {change['target_s']:.0f} s: {'met' if change['met'] else 'MISSED'}]"
        )
        if failover := run.get("failover"):
            print(
                f"  after SIGKILL of {failover['killed']}: all streaming on the other in "
                f"{failover['all_streaming_on_survivor_s']:.1f} s [target <= {failover['target_s']:.0f} s: "
                f"{'met' if failover['met'] else 'MISSED'}]; a mode change then applied everywhere in "
                f"{failover['mode_change_after']['until_all_applied_s']:.1f} s"
            )
            if floor:
                print("  " + over_floor(failover["cpu_ms_per_reconnect"], floor))
        elif run.get("error"):
            print(f"  then: {run['error']}")
    results_write("fleet_scale", results)


if __name__ == "__main__":
    main()

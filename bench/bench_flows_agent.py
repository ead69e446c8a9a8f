#!/usr/bin/env python3
"""The agent's conntrack flow source under connection bursts, inside network namespaces (root).

    .venv/bin/python bench/bench_flows_agent.py [--rates 5000,10000,20000,40000] [--seconds 2]
        [--directions both|inbound|outbound] [--unobserved-outbound]

A client namespace sends UDP datagrams to a workload namespace at a fixed rate, each to a new port, so
each is a new conntrack connection marked by the owned table (simulation mode: would_block). The owned
table is what a real agent applies: the rendered document (outbound mode visibility: no output chain) with
the observe-only output chain the agent adds (agent/outbound_observe.py), which marks every connection the
workload opens outbound (flag 0x80) and observed. `--directions` says who sends: `both` (the default) half
the rate from the client and half the workload's own datagrams to the client, at the same time;
`inbound` the client alone; `outbound` the workload alone. The source records both directions, and the
counts of each are reported. For each
rate, the agent's source (agent/conntrack.py, the default --flow-netlink-buffer) and `conntrack -E`
(conntrack-tools) consume the same burst side by side. Reported per rate: datagrams sent, connections the
kernel created (`conntrack -C`, the ground truth), counted by the agent, lost (created - counted, and
whether a source_overrun gap said so), the agent's CPU seconds
and `conntrack -E`'s for the same events, and their ratio. Then the resident memory of a window
holding 10,000 keys. Targets: no loss at 20,000 connections/s with the default buffer; CPU within 2x of
`conntrack -E`; RSS under 60 MB with 10,000 keys. Results: bench/results/flows_agent.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from benchlib import exit_on_sigterm, results_write  # noqa: E402

HOSTS = {"wl": ("10.79.0.10", None), "client": ("10.79.0.11", None)}

# Sends COUNT datagrams at RATE per second to consecutive ports from one socket: COUNT new connections.
_SENDER = """
import socket, sys, time
host, count, rate = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
start = time.perf_counter()
for i in range(count):
    if i % 50000 == 0:  # a fresh source port every 50,000 ports: every datagram a new 5-tuple
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b"x", (host, 1024 + (i % 50000)))
    if i % 100 == 0:
        ahead = start + i / rate - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)
print(round(count / (time.perf_counter() - start)), flush=True)
"""


def _document(*, observe_outbound: bool = True) -> str:
    """The table a real agent applies for a workload in simulation whose outbound mode is visibility
    (without `observe_outbound`: the rendered document alone, as agents applied it before they recorded
    outgoing connections in visibility, which the source then read and skipped as unmarked: counted 0)."""
    from agent.outbound_observe import with_output_observed
    from policy.render_inputs import FleetIndex, WorkloadInput
    from policy.renderer import render

    workload = WorkloadInput("wl", {"role": "server"}, (HOSTS["wl"][0],), "simulation")
    document = render(workload, [], {}, FleetIndex.build([workload])).document
    return with_output_observed(document) if observe_outbound else document


def _process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _send(lab, rate: int, count: int, *, directions: str) -> list[subprocess.CompletedProcess]:
    """The burst: the client's datagrams to the workload (`inbound`), the workload's own to the client
    (`outbound`), or half of each at the same time (`both`)."""
    senders = {"inbound": [("client", "wl")], "outbound": [("wl", "client")]}.get(
        directions, [("client", "wl"), ("wl", "client")]
    )
    share = len(senders)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    running = [
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                lab.ns(ns),
                sys.executable,
                "-c",
                _SENDER,
                HOSTS[to][0],
                str(count // share),
                str(rate / share),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for ns, to in senders
    ]
    return [subprocess.CompletedProcess(p.args, p.wait(60), *p.communicate()) for p in running]


def burst(lab, nsthread, rate: int, seconds: float, *, directions: str = "both") -> dict:
    from agent import conntrack
    from agent.flowreporter import DEFAULT_NETLINK_BUFFER, LockedWindows

    count = int(rate * seconds)
    lab.run("wl", ["conntrack", "-F"])
    windows = LockedWindows(length=3600, max_keys=10_000_000, accounting=False)  # the agent's
    source = conntrack.ConntrackSource(windows, buffer_bytes=DEFAULT_NETLINK_BUFFER, dump_max=10_000_000)
    nsthread.call(source.subscribe)
    listener = subprocess.Popen(
        ["ip", "netns", "exec", lab.ns("wl"), "conntrack", "-E", "-e", "NEW", "-o", "id", "-b", str(DEFAULT_NETLINK_BUFFER)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(listener.stdout), daemon=True)
    reader.start()
    agent_cpu = [0.0]

    def consume(stop: threading.Event) -> None:
        started = time.thread_time()
        quiet = 0
        while not stop.is_set() or quiet < 2:
            quiet = quiet + 1 if source.read_once(0.5) == 0 else 0
        agent_cpu[0] = time.thread_time() - started

    stop = threading.Event()
    consumer = threading.Thread(target=lambda: nsthread.call(consume, stop))
    time.sleep(0.3)
    listener_cpu_before = _process_cpu(listener.pid)
    consumer.start()
    sent = _send(lab, rate, count, directions=directions)
    # Ground truth: the connections the kernel created (the table was flushed before; UDP entries live 30 s).
    created = int(lab.run("wl", ["conntrack", "-C"]).stdout.strip())
    stop.set()
    consumer.join()
    time.sleep(0.5)
    listener_cpu = _process_cpu(listener.pid) - listener_cpu_before
    listener.terminate()
    listener.wait(10)
    nsthread.call(source.close)
    closed, _ = windows.close_due(float("inf"), "bench")
    counted = sum(c.connection_count for w in closed for _, c in w.groups)
    by_direction: dict[str, int] = {}
    for w in closed:
        for key, c in w.groups:
            by_direction[key.direction] = by_direction.get(key.direction, 0) + c.connection_count
    conntrack_events = sum(1 for line in lines if "[NEW]" in line)
    return {
        "rate_requested": rate,
        "rate_achieved": sum(int(s.stdout.strip() or 0) for s in sent),
        "sent": count // 2 * 2 if directions == "both" else count,
        "agent_counted_by_direction": by_direction,
        "created": created,
        "agent_counted": counted,
        "agent_lost": created - counted,
        "overrun_gaps": len(source.gaps),
        "conntrack_E_events": conntrack_events,
        "agent_cpu_s": round(agent_cpu[0], 3),
        "conntrack_E_cpu_s": round(listener_cpu, 3),
        "agent_cpu_per_10k_connections_s": round(agent_cpu[0] / created * 10_000, 3) if created else None,
        "conntrack_E_cpu_per_10k_connections_s": round(listener_cpu / created * 10_000, 3)
        if created
        else None,
        "cpu_ratio": round(agent_cpu[0] / listener_cpu, 2) if listener_cpu else None,
        # When `conntrack -E` falls behind (a loaded machine) it drops events and its CPU is for less
        # work: then only the CPU per event each one read compares.
        "cpu_ratio_per_event_read": round((agent_cpu[0] / counted) / (listener_cpu / conntrack_events), 2)
        if counted and listener_cpu and conntrack_events
        else None,
    }


def window_memory(keys: int = 10_000) -> dict:
    """Resident memory of a process holding one window with `keys` distinct keys."""
    code = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from agent.flowwindow import FlowKey, Windows
def rss_kb():  # current, not ru_maxrss: that carries the forking parent's high-water mark over exec
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
before = rss_kb()
w = Windows(length=60, max_keys=1_000_000, accounting=True)
for i in range({keys}):
    w.connection_opened(FlowKey(f"10.{{i // 65536}}.{{i // 256 % 256}}.{{i % 256}}", "tcp", 443, "allowed", 7), 1.0)
after = rss_kb()
print(before, after)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = map(int, done.stdout.split())
    return {
        "keys": keys,
        "rss_mb_total": round(after / 1024, 1),
        "rss_mb_for_keys": round((after - before) / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="5000,10000,20000,40000")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--directions", choices=("both", "inbound", "outbound"), default="both")
    parser.add_argument(
        "--unobserved-outbound",
        action="store_true",
        help="apply the rendered document without the agent's observe-only output chain (the baseline: "
        "outgoing connections unmarked, read and skipped)",
    )
    args = parser.parse_args()
    exit_on_sigterm()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from tests.support.netns import Lab, dataplane_call
    from tests.support.nsthread import NamespaceThread

    results: dict = {
        "command": "bench/bench_flows_agent.py",
        "directions": args.directions,
        "outbound_observed": not args.unobserved_outbound,
        "bursts": [],
    }
    with Lab.create(HOSTS) as lab:
        document = _document(observe_outbound=not args.unobserved_outbound)
        assert dataplane_call(lab, "wl", "apply", document)["error"] is None
        lab.run("wl", ["sysctl", "-w", "net.netfilter.nf_conntrack_max=1000000"])
        nsthread = NamespaceThread(lab.ns("wl"))
        try:
            for rate in (int(r) for r in args.rates.split(",")):
                result = burst(lab, nsthread, rate, args.seconds, directions=args.directions)
                results["bursts"].append(result)
                print(
                    f"rate {rate:>6}/s (achieved {result['rate_achieved']:>6}): sent {result['sent']:>7}, "
                    f"created {result['created']:>7}, "
                    f"agent counted {result['agent_counted']:>7} (lost {result['agent_lost']}, "
                    f"overrun gaps {result['overrun_gaps']}; by direction {result['agent_counted_by_direction']}); CPU agent {result['agent_cpu_s']} s, "
                    f"conntrack -E {result['conntrack_E_cpu_s']} s; per 10,000 connections agent "
                    f"{result['agent_cpu_per_10k_connections_s']} s, conntrack -E "
                    f"{result['conntrack_E_cpu_per_10k_connections_s']} s, ratio {result['cpu_ratio']} "
                    f"(target <= 2); conntrack -E read {result['conntrack_E_events']}, ratio per event "
                    f"each read {result['cpu_ratio_per_event_read']}",
                    flush=True,
                )
        finally:
            nsthread.close()
    results["window_memory"] = window_memory()
    lossless = [b["rate_achieved"] for b in results["bursts"] if b["agent_lost"] == 0]
    results["highest_lossless_rate"] = max(lossless) if lossless else 0
    print(
        f"highest rate without loss: {results['highest_lossless_rate']}/s (target >= 20,000); "
        f"window with 10,000 keys: {results['window_memory']['rss_mb_total']} MB RSS in all (target < 60)"
    )
    print(f"max RSS of this run: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")
    results_write("flows_agent", results)


if __name__ == "__main__":
    main()

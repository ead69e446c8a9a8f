"""The agent's apply time for a 10,000-rule document, and the agent daemon's memory.

    .venv/bin/python bench/bench_agent.py [--rules 10000] [--apply-reps 9] [--no-apply] [--no-rss]

Root only (network namespaces and nftables); nothing touches the host's own namespace.

The policy (seeded): 200 address groups of 1-20 IPv4 networks, a pool of 500 service entries (tcp
ports, some tcp ranges and udp ports), and --rules / 500 rulesets of 500 rules (the product's limit
per ruleset), all scoped to every workload. Each rule has one source (an address group, or every
fifteenth `any`) and one service entry, so each policy rule is exactly one nftables rule (an
IPv4-only source gets no IPv6 line; `any` is one line for both families).

1. Apply. The document of an enforced workload under that policy is rendered by policy.renderer
   (the control plane's own renderer, so the text is in the real style: named sets, one line per
   rule, ct marks, comments). A child process inside a throwaway namespace replaces the owned table
   with it, alternately through NftablesDataplane.apply (the agent's path: owned-table check,
   `add table` + `delete table` + document as one batch through a memfd to libnftables) and through
   `nft -f` of the same batch text in /dev/shm (which includes starting the nft process), several
   times each; medians. Target: agent / nft <= 1.3.

2. Memory. `serve` (SQLite in a temporary data directory) and the real agent daemon
   (`python -m agent run`) run in one throwaway namespace, serve on its 127.0.0.1. The agent is
   enrolled with a provisioning token, and its RSS (VmRSS of the python process) is read once it has
   applied its first snapshot (visibility) and sat idle. Then the same policy is written through the
   operator API (address groups, then the rulesets), the workload is switched to enforced
   (POST /mode-changes), and once applied == latest its RSS is read again (VmHWM: the peak). Target:
   under 60 MB both times.

Results: bench/results/agent.json.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchlib import exit_on_sigterm, results_write  # noqa: E402

SEED = 20240905
RULES_PER_RULESET = 500  # policy.validation.MAX_RULES_PER_RULESET
GROUPS = 200
SERVICE_POOL = 500
RATIO_TARGET = 1.3
RSS_TARGET_MB = 60.0
AGENT_COMMAND = [sys.executable, "-m", "agent"]  # the real agent CLI
HEARTBEAT_SECONDS = 15.0  # the agent's default; its table check runs with each heartbeat
SAMPLE_SECONDS = HEARTBEAT_SECONDS + 5  # RSS windows span at least one heartbeat


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


# --- the policy, as plain data (the API's shapes), and as renderer inputs -------------------------


def build_policy(rule_count: int, deny_share: float = 0.0) -> dict:
    """`deny_share` of the rules (every n-th by number: the policy is otherwise the same) are deny rules."""
    deny_every = round(1 / deny_share) if deny_share else 0
    rng = random.Random(SEED)
    groups = []
    for g in range(GROUPS):
        members = set()
        for _ in range(rng.randrange(1, 21)):
            prefix = rng.choice((16, 20, 24, 24, 28, 32, 32))
            network = ipaddress.ip_network(
                f"172.{16 + g % 16}.{rng.randrange(256)}.{rng.randrange(256)}/{prefix}", strict=False
            )
            members.add(str(network.network_address) if prefix == 32 else str(network))
        groups.append({"name": f"bgrp-{g:03d}", "members": sorted(members)})
    pool, seen = [], set()
    while len(pool) < SERVICE_POOL:
        kind = rng.random()
        if kind < 0.8:
            entry = ("tcp", rng.randrange(1, 65536), None)
        elif kind < 0.9:
            low = rng.randrange(1024, 60000)
            entry = ("tcp", low, low + rng.randrange(1, 100))
        else:
            entry = ("udp", rng.randrange(1, 65536), None)
        if entry not in seen:
            seen.add(entry)
            pool.append(entry)
    rulesets = []
    for r in range((rule_count + RULES_PER_RULESET - 1) // RULES_PER_RULESET):
        rules = []
        for position in range(min(RULES_PER_RULESET, rule_count - r * RULES_PER_RULESET)):
            number = r * RULES_PER_RULESET + position
            if number % 15 == 14:
                source = {"any": True}
            else:
                source = {"address_group": f"bgrp-{rng.randrange(GROUPS):03d}"}
            protocol, port, port_to = pool[rng.randrange(SERVICE_POOL)]
            service = {"protocol": protocol, "port": port}
            if port_to is not None:
                service["port_to"] = port_to
            rule = {"description": f"bench rule {number}", "sources": [source], "services": [service]}
            if deny_every and number % deny_every == deny_every - 1:
                rule["action"] = "deny"
            rules.append(rule)
        rulesets.append({"name": f"bench-rs-{r:02d}", "scope": "", "rules": rules})
    return {"groups": groups, "rulesets": rulesets}


def render_document(policy: dict) -> tuple[str, int]:
    """The enforced document of one workload under `policy`, by policy.renderer; and its rule count."""
    from policy.grammar import parse_selector
    from policy.render_inputs import (
        AddressGroupInput,
        FleetIndex,
        PortEntry,
        RuleInput,
        RulesetInput,
        SourceInput,
        WorkloadInput,
    )
    from policy.renderer import render

    groups = {
        f"gid-{g['name']}": AddressGroupInput(f"gid-{g['name']}", g["name"], tuple(g["members"]))
        for g in policy["groups"]
    }
    rulesets, numbered = [], []
    for r, ruleset in enumerate(policy["rulesets"]):
        rules = []
        for position, rule in enumerate(ruleset["rules"]):
            sources = tuple(
                SourceInput("any")
                if "any" in s
                else SourceInput("address_group", address_group_id=f"gid-{s['address_group']}")
                for s in rule["sources"]
            )
            entries = tuple(
                PortEntry(s["protocol"], s["port"], s.get("port_to", s["port"])) for s in rule["services"]
            )
            rules.append(
                RuleInput(
                    f"rule-{r}-{position}",
                    position,
                    rule["description"],
                    sources,
                    entries,
                    number=len(numbered) + 1,
                    action=rule.get("action", "allow"),
                )
            )
            numbered.append(rules[-1])
        rulesets.append(
            RulesetInput(f"rs-{r}", ruleset["name"], parse_selector(ruleset["scope"]), tuple(rules))
        )
    workload = WorkloadInput("wl-bench", {"app": "bench"}, ("10.99.0.1",), "enforced")
    result = render(workload, rulesets, groups, FleetIndex.build([workload]))
    return result.document, len(result.rule_index)


def chain_rule_count(listing: str) -> int:
    """nftables rules in `nft -a list table` output: the lines of chains that carry a handle."""
    count, in_chain = 0, False
    for line in listing.splitlines():
        stripped = line.strip()
        if stripped.startswith("chain "):
            in_chain = True
        elif stripped.startswith(("set ", "map ")):
            in_chain = False
        elif in_chain and "# handle" in stripped and not stripped.startswith(("type ", "chain ")):
            count += 1
    return count


# --- 1. apply: runs in a child inside a throwaway namespace ---------------------------------------


def apply_child(document_path: str, reps: int) -> None:
    from agent.dataplane import BATCH_HEADER, NftablesDataplane, owned_table_problem

    document = Path(document_path).read_text()
    dataplane = NftablesDataplane()
    with tempfile.NamedTemporaryFile("w", suffix=".nft", delete=False, dir="/dev/shm") as batch:
        batch.write(BATCH_HEADER + document)
    try:
        dataplane.apply(document)  # both then replace an existing table, as the agent does
        subprocess.run(["nft", "-f", batch.name], check=True)
        agent, nft, check = [], [], []
        for rep in range(reps):
            order = ("agent", "nft") if rep % 2 == 0 else ("nft", "agent")
            for which in order:
                t0 = time.perf_counter()
                if which == "agent":
                    dataplane.apply(document)
                    agent.append(time.perf_counter() - t0)
                else:
                    subprocess.run(["nft", "-f", batch.name], check=True)
                    nft.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert owned_table_problem(document) is None
            check.append(time.perf_counter() - t0)
        listed = subprocess.run(
            ["nft", "-a", "list", "table", "inet", "palisade"], capture_output=True, text=True, check=True
        ).stdout
        # What the agent's table check (every heartbeat) costs with this table in the kernel:
        # NftablesDataplane.table_present() on a context of its own, after the memory of the
        # applies is given back.
        import ctypes
        import gc

        del dataplane
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        checker = NftablesDataplane()
        before = _proc_status(os.getpid())["VmRSS"]
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak of the checks alone
            peak_known = True
        except OSError:
            peak_known = False
        present = []
        for _ in range(3):
            t0 = time.perf_counter()
            assert checker.table_present()
            present.append(time.perf_counter() - t0)
        after = _proc_status(os.getpid())
        present_rss_kb = after["VmRSS"] - before  # what stays after the checks
        present_peak_kb = after["VmHWM"] - before if peak_known else None  # while checking
    finally:
        os.unlink(batch.name)
    print(
        json.dumps(
            {
                "agent_s": agent,
                "nft_f_s": nft,
                "owned_table_check_s": check,
                "table_present_s": present,
                "table_present_rss_growth_kb": present_rss_kb,
                "table_present_peak_growth_kb": present_peak_kb,
                "table_rules": chain_rule_count(listed),
                "table_sets": len(re.findall(r"^\s*set ", listed, re.MULTILINE)),
            }
        )
    )


def bench_apply(document: str, reps: int) -> dict:
    namespace = f"palbencha{os.getpid()}"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    handle = tempfile.NamedTemporaryFile("w", suffix=".nft", delete=False)
    try:
        with handle:
            handle.write(document)
        env = dict(os.environ, PYTHONPATH=str(REPO))
        done = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                namespace,
                sys.executable,
                __file__,
                "--apply-child",
                handle.name,
                str(reps),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"apply child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    finally:
        os.unlink(handle.name)
        subprocess.run(["ip", "netns", "del", namespace], check=False)
    raw = json.loads(done.stdout)
    agent, nft = statistics.median(raw["agent_s"]), statistics.median(raw["nft_f_s"])
    return {
        "repetitions": reps,
        "agent_median_s": agent,
        "nft_f_median_s": nft,
        "agent_min_s": min(raw["agent_s"]),
        "agent_max_s": max(raw["agent_s"]),
        "nft_f_min_s": min(raw["nft_f_s"]),
        "nft_f_max_s": max(raw["nft_f_s"]),
        "owned_table_check_median_s": statistics.median(raw["owned_table_check_s"]),
        "table_present_median_s": statistics.median(raw["table_present_s"]),
        "table_present_rss_growth_mb": raw["table_present_rss_growth_kb"] / 1024,
        "table_present_peak_growth_mb": (
            raw["table_present_peak_growth_kb"] / 1024
            if raw["table_present_peak_growth_kb"] is not None
            else None
        ),
        "ratio_agent_over_nft": agent / nft,
        "target_ratio": RATIO_TARGET,
        "met": agent / nft <= RATIO_TARGET,
        "table_rules": raw["table_rules"],
        "table_sets": raw["table_sets"],
        "raw_agent_s": raw["agent_s"],
        "raw_nft_f_s": raw["nft_f_s"],
    }


# --- 2. memory: serve and the agent daemon in one namespace ---------------------------------------


def _proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile in kB."""
    found = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "Threads"):
                found[key] = int(value.split()[0])
    return found


def _python_pid(pid: int, timeout: float = 10.0) -> int:
    """`ip netns exec` execs its command, so the pid becomes python's; wait for the exec, and check
    rather than assume (a forking `ip` would leave python as its only child)."""
    deadline = time.monotonic() + timeout
    while True:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if "python" in Path(cmdline[0].decode()).name:
            return pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if len(children) == 1:
            return _python_pid(int(children[0]), timeout)
        if time.monotonic() > deadline:
            raise RuntimeError(f"cannot find the python process of {pid}: {cmdline}")
        time.sleep(0.05)


def _rss_sample(pid: int, seconds: float, interval: float = 0.5) -> dict:
    samples = []
    deadline = time.monotonic() + seconds
    while True:
        samples.append(_proc_status(pid))
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    last = samples[-1]
    return {
        "vm_rss_mb": last["VmRSS"] / 1024,
        "vm_rss_max_of_samples_mb": max(s["VmRSS"] for s in samples) / 1024,
        "vm_hwm_mb": last["VmHWM"] / 1024,
        "rss_anon_mb": last["RssAnon"] / 1024,
        "rss_file_mb": last["RssFile"] / 1024,
        "threads": last["Threads"],
        "samples": len(samples),
    }


def bench_rss(policy: dict, deadline_s: float) -> dict:
    import httpx

    from tests.support.nsthread import NamespaceThread
    from tests.support.serve_process import ServeProcess, _drain, served_certificate, terminate

    namespace = f"palbenchr{os.getpid()}"
    deadline = time.monotonic() + deadline_s
    work = Path(tempfile.mkdtemp(prefix="palisade-bench-agent-"))
    serve = agent = thread = client = None
    agent_lines: list[str] = []

    def remaining(cap: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the memory benchmark ran out of time")
        return min(cap, left)

    class NamespacedServe(ServeProcess):
        @property
        def args(self):
            return ["ip", "netns", "exec", namespace, *super().args]

        def wait_ready(self, timeout: float = 90.0) -> None:
            end = time.monotonic() + timeout
            for listener in ("operator", "gateway"):
                while True:
                    if self.process.poll() is not None:
                        raise RuntimeError(f"serve exited {self.process.returncode}:\n{self.stderr_text()}")
                    try:
                        self._served[listener] = thread.call(served_certificate, *self.address(listener), 2)
                        break
                    except OSError:
                        if time.monotonic() > end:
                            raise RuntimeError(f"serve did not listen:\n{self.stderr_text()}") from None
                        time.sleep(0.1)

    def api(method: str, path: str, body=None, expect=(200, 201, 202)):
        response = thread.call(lambda: client.request(method, "/api/v1" + path, json=body))
        if response.status_code not in expect:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text[:2000]}")
        return response.json()

    def workload() -> dict:
        items = api("GET", "/workloads?limit=10")["items"]
        return items[0] if items else {}

    def wait_converged(what: str, timeout: float) -> tuple[dict, float]:
        started = time.monotonic()
        end = started + remaining(timeout)
        last = None
        while time.monotonic() < end:
            last = workload()
            if (
                last
                and last["sync"]["state"] == "synced"
                and last["latest_version"]
                and last["applied_version"] == last["latest_version"]
            ):
                return last, time.monotonic() - started
            if agent.poll() is not None:
                raise RuntimeError(f"the agent exited {agent.returncode}:\n{''.join(agent_lines)[-4000:]}")
            time.sleep(0.2)
        raise TimeoutError(
            f"{what}: not converged; last {last!r}\nagent log:\n{''.join(agent_lines)[-4000:]}"
        )

    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        subprocess.run(["ip", "-n", namespace, "link", "set", "lo", "up"], check=True)
        thread = NamespaceThread(namespace)
        os.environ.pop("DATABASE_URL", None)  # SQLite in the data directory
        os.environ.pop("REDIS_URL", None)
        serve = NamespacedServe(work / "data", env={"PALISADE_LOG_LEVEL": "WARNING"})
        serve.start(timeout=remaining(120))
        token = serve.mint_operator_token("bench-agent")
        client = thread.call(lambda: serve.client("operator", headers={"Authorization": f"Bearer {token}"}))
        client.timeout = httpx.Timeout(120)
        bundle = api("POST", "/provisioning-tokens", {"description": "bench agent", "max_uses": 1})["bundle"]

        state_dir = work / "agent-state"
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        enrolled = subprocess.run(
            ["ip", "netns", "exec", namespace, *AGENT_COMMAND, "enrol", "--bundle-file", "-",
             "--state-dir", str(state_dir), "--hostname", "bench-agent", "--address", "10.99.0.1"],
            input=bundle, capture_output=True, text=True, env=env, cwd=REPO, timeout=remaining(60),
        )  # fmt: skip
        if enrolled.returncode != 0:
            raise RuntimeError(f"enrol failed: {enrolled.stderr}")
        agent = subprocess.Popen(
            ["ip", "netns", "exec", namespace, *AGENT_COMMAND, "run", "--state-dir", str(state_dir)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
        )  # fmt: skip
        threading.Thread(target=_drain, args=(agent.stderr, agent_lines), daemon=True).start()
        agent_pid = _python_pid(agent.pid)

        first, first_seconds = wait_converged("first snapshot", 60)
        time.sleep(3)
        # Idle: the window spans more than one heartbeat, whose table check is part of idling.
        idle = _rss_sample(agent_pid, SAMPLE_SECONDS)

        # The policy, through the operator API. The workload is in visibility mode, whose document
        # does not depend on rules, so the agent receives nothing until the mode changes.
        authored = time.monotonic()
        for group in policy["groups"]:
            api("POST", "/address-groups", group)
        for ruleset in policy["rulesets"]:
            remaining(1)
            api("POST", "/rulesets", ruleset)
        authored = time.monotonic() - authored

        changed = time.monotonic()
        api("POST", "/mode-changes", {"selection": {"all": True}, "mode": "enforced"})
        post_seconds = time.monotonic() - changed
        enforced, converge_seconds = wait_converged("enforced snapshot", 300)
        converge_seconds += post_seconds
        just_applied = _proc_status(agent_pid)
        time.sleep(3)
        after = _rss_sample(agent_pid, SAMPLE_SECONDS)

        rendered = api("GET", f"/workloads/{enforced['id']}/rendered-policy")
        document = rendered.get("document", "")
        listed = subprocess.run(
            ["ip", "netns", "exec", namespace, "nft", "-a", "list", "table", "inet", "palisade"],
            capture_output=True, text=True, timeout=remaining(60),
        ).stdout  # fmt: skip
        applied_lines = [line for line in agent_lines if " applied " in line]
        result = {
            "first_snapshot": {"mode": first["mode"], "seconds_to_synced": first_seconds},
            "idle_after_first_snapshot": idle,
            "authoring_s": authored,
            "enforced": {
                "document_bytes": len(document.encode()),
                "rule_index_entries": len(rendered.get("rule_index") or {}),
                "table_rules": chain_rule_count(listed),
                "table_sets": len(re.findall(r"^\s*set ", listed, re.MULTILINE)),
                "mode_change_post_s": post_seconds,
                "seconds_to_applied": converge_seconds,
            },
            "rss_just_after_enforced_apply_mb": just_applied["VmRSS"] / 1024,
            "after_enforced_apply": after,
            "agent_log_applied": applied_lines[-3:],
            "target_mb": RSS_TARGET_MB,
            "met": idle["vm_rss_max_of_samples_mb"] < RSS_TARGET_MB
            and after["vm_rss_max_of_samples_mb"] < RSS_TARGET_MB,
        }
    finally:
        if agent is not None:
            terminate(agent)
        if serve is not None and serve.process is not None:
            try:
                serve.stop()
            except AssertionError:
                serve.kill()
        if thread is not None:
            thread.close()
        subprocess.run(["ip", "netns", "del", namespace], check=False)
        shutil.rmtree(work, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rules", type=int, default=10_000)
    parser.add_argument("--apply-reps", type=int, default=9)
    parser.add_argument("--no-apply", action="store_true")
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--timeout", type=float, default=900, help="bound for the memory part, seconds")
    parser.add_argument("--apply-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--deny-share", type=float, default=0.1, help="the share of deny rules (issue 33)")
    args = parser.parse_args()
    exit_on_sigterm()
    if args.apply_child:
        apply_child(args.apply_child[0], int(args.apply_child[1]))
        return
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("nft"):
        print("bench_agent: needs root, ip and nft (network namespaces); skipped")
        return

    policy = build_policy(args.rules, args.deny_share)
    t0 = time.perf_counter()
    document, rules = render_document(policy)
    results: dict = {
        "policy": {
            "rules": rules,
            "deny_rules": sum(r.get("action") == "deny" for rs in policy["rulesets"] for r in rs["rules"]),
            "rulesets": len(policy["rulesets"]),
            "address_groups": len(policy["groups"]),
            "service_entries_pool": SERVICE_POOL,
            "document_bytes": len(document.encode()),
            "render_s": time.perf_counter() - t0,
        }
    }
    print(
        f"policy: {rules} rules in {len(policy['rulesets'])} rulesets, {len(policy['groups'])} address groups; "
        f"rendered document {len(document.encode()) / 1024:.0f} KiB"
    )
    if args.no_apply:
        results["apply"] = {"skipped": "--no-apply"}
    else:
        apply = results["apply"] = bench_apply(document, args.apply_reps)
        print(
            f"apply ({apply['table_rules']} nftables rules, {apply['table_sets']} sets in the table): "
            f"agent (NftablesDataplane.apply) {apply['agent_median_s'] * 1e3:.0f} ms, "
            f"nft -f {apply['nft_f_median_s'] * 1e3:.0f} ms (medians of {apply['repetitions']}); "
            f"ratio {apply['ratio_agent_over_nft']:.2f} [target <= {RATIO_TARGET}: "
            f"{'met' if apply['met'] else 'MISSED'}]; owned-table check "
            f"{apply['owned_table_check_median_s'] * 1e3:.1f} ms of it"
        )
        print(
            f"table check with this table in the kernel (NftablesDataplane.table_present, every heartbeat): "
            f"{apply['table_present_median_s'] * 1e3:.0f} ms; RSS +{apply['table_present_rss_growth_mb']:.0f} MB "
            f"after it, +{apply['table_present_peak_growth_mb'] or 0:.0f} MB at its peak"
        )
    if args.no_rss:
        results["rss"] = {"skipped": "--no-rss"}
    else:
        rss = results["rss"] = bench_rss(policy, args.timeout)
        idle, after, enforced = rss["idle_after_first_snapshot"], rss["after_enforced_apply"], rss["enforced"]
        print(
            f"agent RSS idle after its first (visibility) snapshot, over {SAMPLE_SECONDS:.0f} s: "
            f"max {idle['vm_rss_max_of_samples_mb']:.1f} MB, last {idle['vm_rss_mb']:.1f} MB "
            f"(peak so far {idle['vm_hwm_mb']:.1f} MB)"
        )
        print(f"policy written through the API in {rss['authoring_s']:.1f} s")
        print(
            f"agent RSS after applying the enforced document ({enforced['table_rules']} nftables rules, "
            f"{enforced['document_bytes'] / 1024:.0f} KiB, applied {enforced['seconds_to_applied']:.1f} s after "
            f"the mode change): {rss['rss_just_after_enforced_apply_mb']:.1f} MB just after; over the next "
            f"{SAMPLE_SECONDS:.0f} s max {after['vm_rss_max_of_samples_mb']:.1f} MB, last {after['vm_rss_mb']:.1f} MB "
            f"(peak during the apply {after['vm_hwm_mb']:.1f} MB) "
            f"[target < {RSS_TARGET_MB:.0f} MB both: {'met' if rss['met'] else 'MISSED'}]"
        )
    results["source"] = source_state()
    results["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "nft": subprocess.run(["nft", "--version"], capture_output=True, text=True).stdout.strip(),
    }
    results_write("agent", results)


if __name__ == "__main__":
    main()

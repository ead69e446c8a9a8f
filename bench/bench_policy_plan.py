#!/usr/bin/env python3
"""The plan of the largest policy file the limits admit, against the time to parse the same file.

    .venv/bin/python bench/bench_policy_plan.py [--workloads 100] [--database palisade_bench_policy_plan]

Needs PostgreSQL (DATABASE_URL names the server; a throwaway database, --database, is made and
dropped). A fleet of --workloads workloads labelled `app=a0` .. `app=a19`, no stored policy, and two
files at the limits of a policy file (flows/policy_drafts/as_code/format.py and parse.py), each
planned as `manage.py policy plan FILE` plans it (`policy_file_load`, then `policy_plan`: the file's
checks, the comparison with the stored policy, the render dry-run of every workload and the impact
over the last 7 days):

- many rules: the most rules a file holds (MAX_FILE_RULES), 500 a ruleset, each from one selector to
  one port, scoped to one of the 20 apps (each workload gets a twentieth of them);
- dense rules: rules of 64 selector sources and 64 services each, in a file just under
  MAX_FILE_BYTES (the rules per byte a file can hold that cost the most to check and render).

The baseline is measured in the same run: the time to parse the same file (`policy_file_load`, YAML
1.2 read with libyaml). Target: load and plan of each file within 60 s. Results:
bench/results/policy_plan.json.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_flows  # noqa: E402
from bench_flows import log  # noqa: E402
from benchlib import exit_on_sigterm, results_write  # noqa: E402

TARGET_SECONDS = 60.0
APPS = 20


def many_rules(rules: int) -> dict:
    per = 500
    return {
        "version": 1,
        "services": [],
        "address_groups": [],
        "rulesets": [
            {
                "name": f"ruleset {r}",
                "scope": f"app=a{r % APPS}",
                "rules": [
                    {
                        "sources": [{"selector": f"app=a{(r + i) % APPS}"}],
                        "services": [{"protocol": "tcp", "port": 1 + (r * per + i) % 65535}],
                    }
                    for i in range(min(per, rules - r * per))
                ],
            }
            for r in range((rules + per - 1) // per)
        ],
    }


def dense_rule(n: int) -> dict:
    return {
        "sources": [{"selector": f"app=a{(n + s) % APPS},tier=t{s}"} for s in range(64)],
        "services": [{"protocol": "tcp", "port": 1 + (n * 64 + p) % 65535} for p in range(64)],
    }


def dense_rules(max_bytes: int) -> tuple[dict, str]:
    """Dense rules, 500 a ruleset, as many as the file's bytes hold."""
    from flows.policy_drafts.as_code.format import dump

    one = len(dump({"rulesets": [{"rules": [dense_rule(0)]}]}, format="yaml"))
    count = max_bytes // one
    while True:
        data: dict = {"version": 1, "services": [], "address_groups": [], "rulesets": []}
        for n in range(count):
            if n % 500 == 0:
                data["rulesets"].append(
                    {"name": f"dense {n // 500}", "scope": f"app=a{n // 500 % APPS}", "rules": []}
                )
            data["rulesets"][-1]["rules"].append(dense_rule(n))
        text = dump(data, format="yaml")
        if len(text) <= max_bytes:
            return data, text
        count -= 1 + count // 100


def measure(name: str, text: str) -> dict:
    from flows.policy_drafts.as_code.format import policy_file_load
    from flows.policy_drafts.as_code.plan import policy_plan

    began = time.perf_counter()
    data = policy_file_load(text=text, source=f"{name}.yaml")
    loaded = time.perf_counter() - began
    began = time.perf_counter()
    plan = policy_plan(data=data)
    planned = time.perf_counter() - began
    rules = sum(len(r["rules"]) for r in data["rulesets"])
    total = loaded + planned
    log(
        f"{name}: {len(text) / 2**20:.1f} MiB, {len(data['rulesets'])} rulesets, {rules} rules: "
        f"baseline (parse) {loaded:.1f} s, plan {planned:.1f} s ({planned / loaded:.1f}x the parse), "
        f"load and plan {total:.1f} s: TARGET (< {TARGET_SECONDS:.0f} s) "
        f"{'met' if total < TARGET_SECONDS else 'MISSED'}; {plan['render']['changed_count']} documents change"
    )
    return {
        "bytes": len(text),
        "rulesets": len(data["rulesets"]),
        "rules": rules,
        "parse_seconds": round(loaded, 2),
        "plan_seconds": round(planned, 2),
        "plan_over_parse": round(planned / loaded, 2),
        "total_seconds": round(total, 2),
        "target_met": total < TARGET_SECONDS,
    }


def main() -> int:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", type=int, default=100)
    parser.add_argument("--database", default="palisade_bench_policy_plan")
    args = parser.parse_args()
    bench_flows.DB_NAME = args.database
    bench_flows.DB_URL = bench_flows.ADMIN_URL.rsplit("/", 1)[0] + "/" + args.database
    bench_flows.database(create=True)
    try:
        bench_flows.django_setup()
        from fleet.models import Workload
        from flows.policy_drafts.as_code.format import MAX_FILE_BYTES, dump
        from flows.policy_drafts.as_code.parse import MAX_FILE_RULES

        bench_flows.workloads_insert(args.workloads, {}, random.Random(20261128))
        for i, workload in enumerate(Workload.objects.order_by("hostname")):
            workload.labels = {"app": f"a{i % APPS}", "tier": f"t{i % 64}"}
            workload.save(update_fields=["labels"])
        results = {"args": vars(args), "max_file_bytes": MAX_FILE_BYTES, "max_file_rules": MAX_FILE_RULES}
        results["many_rules"] = measure("many-rules", dump(many_rules(MAX_FILE_RULES), format="yaml"))
        _, text = dense_rules(MAX_FILE_BYTES)
        results["dense_rules"] = measure("dense-rules", text)
        results["targets_met"] = results["many_rules"]["target_met"] and results["dense_rules"]["target_met"]
        results_write("policy_plan", results)
    finally:
        from django.db import connections

        connections.close_all()
        bench_flows.database(create=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

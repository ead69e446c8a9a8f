#!/usr/bin/env python3
"""Policy from evidence on PostgreSQL: suggested rules and a draft's impact against the rollup.

    .venv/bin/python bench/bench_policy_evidence.py [--workloads 1000] [--hours 24] [--keys 5]
        [--rules 50] [--samples 30] [--database palisade_bench_policy_evidence] [--keep-database]

Needs PostgreSQL (DATABASE_URL names the server; a throwaway database, --database, is made and
dropped, unless --keep-database). The data is the rollup benchmark's (bench/bench_flows.py
`workloads_insert` and `load_rollup_data`, reused): --workloads workloads (label `group=rollup`) with a
window a minute for --hours hours of --keys keys each (peer 192.0.0.k, tcp/443+k), loaded with COPY and
summed by the real `flow_windows_sum`. Then, so that the two reads have work to do:
- each workload gets an `app` label of one of 20 values (`app=svc-0` .. `svc-19`);
- every key but tcp/443 is recorded as `observed` (a fleet in `visibility`: what suggestions learn
  from), in the minute rows and every sum alike;
- the policy in force: one ruleset (scope `group=rollup`) admitting tcp/443-444 from an address group
  of the peers 192.0.0.0/31.

Measured in one run, interleaved sample by sample (the machine is shared, so each figure is compared
with the baseline of the same moments), p95 of --samples runs each:
- baseline: the rollup of the range grouped by workload, peer and service, every row, with its coverage
  (`flows.selectors.flow_rollup_read`, what `manage.py flows rollup` reads; the two reads below sum the
  same keys of the same range, every one of them);
- suggestions: `flows.policy_drafts.suggestions.policy_suggest_request` (POST /policies/suggestions'
  body: the selection `group=rollup`, the range, `label_keys` ["app"]);
- impact: `flows.policy_drafts.impact.policy_impact` (POST /policies/impact's body: the selection, the
  range and a draft of --rules rules in ten rulesets, as POST /policies/render-dryrun takes it).
Targets: p95 of each under 500 ms and no more than 2x the baseline's p95. Each read's time is split
into its SQL (the database cursor's time, captured) and the rest (Python: classification, merging,
the answer). Results: bench/results/policy_evidence.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_flows  # noqa: E402
from bench_flows import log  # noqa: E402
from benchlib import exit_on_sigterm, results_write  # noqa: E402

P95_TARGET_MS = 500.0
RATIO_TARGET = 2.0
APPS = 20
SELECTION = ["group=rollup"]
SUM_TABLES = ("flows_flowgroup", "flows_flowquarter", "flows_flowhour", "flows_flowblock")


def evidence_shape() -> None:
    """The rollup's data made into a fleet that suggestions and the impact have work on (see the module)."""
    import psycopg

    log("labelling the workloads and recording every key but tcp/443 as observed")
    with psycopg.connect(bench_flows.DB_URL, autocommit=True) as conn:
        conn.execute(
            "UPDATE fleet_workload SET labels = labels || jsonb_build_object('app', 'svc-' || "
            "(('x' || substr(md5(id::text), 1, 8))::bit(32)::int & 1023) %% %s) WHERE labels->>'group' = 'rollup'",
            [APPS],
        )
        for table in SUM_TABLES:
            conn.execute(f"UPDATE {table} SET decision = 'observed' WHERE port <> 443")  # noqa: S608 - ours
        conn.execute("VACUUM ANALYZE")


def policy_in_force() -> None:
    from controlplane.auth.actor import CLI_ACTOR
    from policy.services import address_group_create, ruleset_create

    address_group_create(actor=CLI_ACTOR, data={"name": "edge", "members": ["192.0.0.0/31"]})
    ruleset_create(
        actor=CLI_ACTOR,
        data={
            "name": "rollup-now",
            "scope": "group=rollup",
            "rules": [
                {
                    "sources": [{"address_group": "edge"}],
                    "services": [{"protocol": "tcp", "port": 443}, {"protocol": "tcp", "port": 444}],
                }
            ],
        },
    )


def draft(rules: int) -> dict:
    """A draft of `rules` rules in ten rulesets (POST /policies/render-dryrun's body): most admit
    services nobody used, from selectors, groups and anywhere; among them the tcp/443 rule kept (and
    tcp/444 dropped: newly refused), and tcp/445-446 from the peers admitted for half the apps (newly
    admitted)."""
    per = max(1, rules // 10)
    rulesets = []
    made = 0
    for r in range(10):
        apps = ", ".join(f"svc-{a}" for a in range(r * APPS // 10, (r + 1) * APPS // 10))
        body = []
        for i in range(per if r < 9 else rules - made):
            n = made + i
            if n == 0:
                sources, services = [{"address_group": "edge"}], [{"protocol": "tcp", "port": 443}]
            elif n % 10 == 1 and r < 5:
                sources, services = (
                    [{"address_group": "peers"}],
                    [{"protocol": "tcp", "port": 445, "port_to": 446}],
                )
            elif n % 3 == 0:
                sources, services = (
                    [{"selector": f"app=svc-{n % APPS}"}],
                    [{"protocol": "tcp", "port": 5000 + n}],
                )
            elif n % 3 == 1:
                sources, services = [{"address_group": "office"}], [{"protocol": "udp", "port": 6000 + n}]
            else:
                sources, services = (
                    [{"any": True}],
                    [{"protocol": "tcp", "port": 7000 + n, "port_to": 7010 + n}],
                )
            body.append({"sources": sources, "services": services})
        made += len(body)
        rulesets.append({"name": f"draft-{r}", "scope": f"group=rollup, app in ({apps})", "rules": body})
    return {
        "rulesets": rulesets,
        "address_groups": [
            {"name": "edge", "members": ["192.0.0.0/31"]},
            {"name": "peers", "members": [f"192.0.0.{k}" for k in range(8)]},
            {"name": "office", "members": ["10.9.0.0/16", "2001:db8::/48"]},
        ],
    }


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] * 1e3 if len(values) >= 2 else values[0] * 1e3


def bench_reads(hours: int, rules: int, samples: int) -> dict:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from fleet.selectors import label_filters_parse
    from flows.policy_drafts.impact import policy_impact
    from flows.policy_drafts.suggestions import policy_suggest_request
    from flows.selectors import flow_rollup_read, workloads_selected

    end = datetime.now(UTC).replace(microsecond=0)
    start = end - timedelta(hours=hours)
    span = {"from": start.isoformat().replace("+00:00", "Z"), "to": end.isoformat().replace("+00:00", "Z")}
    body = draft(rules)

    def rollup():
        selected = workloads_selected(workload_ids=[], labels=label_filters_parse(SELECTION))
        return flow_rollup_read(
            selected=selected,
            group_by=["workload", "peer", "service"],
            start=start,
            end=end,
            cursor=None,
            limit=None,
        )

    def suggest():
        return policy_suggest_request(data={"label": SELECTION, **span, "label_keys": ["app"]})

    def impact():
        return policy_impact(data={**body, "label": SELECTION, **span})

    reads = {"rollup": rollup, "suggestions": suggest, "impact": impact}
    answers = {name: read() for name, read in reads.items()}  # warm: the plans, the fleet's caches
    times: dict[str, list[float]] = {name: [] for name in reads}
    sql: dict[str, list[float]] = {name: [] for name in reads}
    queries: dict[str, int] = {}
    order = list(reads)
    for i in range(samples):
        for name in order[i % 3 :] + order[: i % 3]:  # each read in each place of the round in turn
            with CaptureQueriesContext(connection) as captured:
                began = time.perf_counter()
                reads[name]()
                times[name].append(time.perf_counter() - began)
            sql[name].append(sum(float(q["time"]) for q in captured.captured_queries))
            queries[name] = len(captured.captured_queries)

    rollup_rows = len(answers["rollup"].rows)
    suggestion, impacted = answers["suggestions"], answers["impact"]
    out: dict = {
        "range": span,
        "keys": rollup_rows,
        "suggestion": {
            "rulesets": len(suggestion["rulesets"]),
            "rules": sum(len(r["rules"]) for r in suggestion["rulesets"]),
            "address_groups": len(suggestion["address_groups"]),
            "not_generalised_count": suggestion["not_generalised_count"],
            "admitted_now_count": suggestion["admitted_now_count"],
            "complete": suggestion["complete"],
        },
        "impact": {
            "keys_classified": impacted["keys_classified"],
            "newly_refused": impacted["newly_refused_summary"],
            "newly_admitted": impacted["newly_admitted_summary"],
            "complete": impacted["coverage"]["complete"],
        },
        "reads": {},
    }
    base = p95(times["rollup"])
    for name in reads:
        figure = p95(times[name])
        out["reads"][name] = {
            "p95_ms": round(figure, 1),
            "p50_ms": round(statistics.median(times[name]) * 1e3, 1),
            "sql_p50_ms": round(statistics.median(sql[name]) * 1e3, 1),
            "python_p50_ms": round(
                statistics.median(t - s for t, s in zip(times[name], sql[name], strict=True)) * 1e3, 1
            ),
            "queries": queries[name],
            "ratio_over_rollup": round(figure / base, 2),
        }
        if name != "rollup":
            out["reads"][name]["p95_target_met"] = figure < P95_TARGET_MS
            out["reads"][name]["ratio_target_met"] = figure / base <= RATIO_TARGET
    return out


def main() -> int:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", type=int, default=1000)
    parser.add_argument("--hours", type=int, default=24)
    parser.add_argument("--keys", type=int, default=5, help="keys of each window (the rollup benchmark's: 5)")
    parser.add_argument("--rules", type=int, default=50, help="rules of the draft whose impact is read")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--database", default="palisade_bench_policy_evidence")
    parser.add_argument(
        "--keep-database", action="store_true", help="leave the database for a look at its plans afterwards"
    )
    args = parser.parse_args()
    # bench_flows' functions connect to the database its module names.
    bench_flows.DB_NAME = args.database
    bench_flows.DB_URL = bench_flows.ADMIN_URL.rsplit("/", 1)[0] + "/" + args.database
    bench_flows.database(create=True)
    try:
        bench_flows.django_setup()
        ids = bench_flows.workloads_insert(args.workloads, {"group": "rollup"}, random.Random(20261127))
        began = time.perf_counter()
        bench_flows.load_rollup_data(ids, args.hours, args.keys)
        evidence_shape()
        policy_in_force()
        loaded = time.perf_counter() - began
        log(f"data loaded in {loaded:.0f} s; {args.samples} samples of each read, interleaved")
        results = bench_reads(args.hours, args.rules, args.samples)
        base = results["reads"]["rollup"]
        log(f"{results['keys']} keys (workload, peer, service) in the range; suggestion: "
            f"{results['suggestion']}; impact: {results['impact']}")  # fmt: skip
        log(f"baseline: rollup of {args.workloads} workloads x {args.hours} h by workload, peer and service, "
            f"every row, with coverage: p95 {base['p95_ms']} ms (p50 {base['p50_ms']}; SQL {base['sql_p50_ms']}, "
            f"Python {base['python_p50_ms']})")  # fmt: skip
        met = True
        for name in ("suggestions", "impact"):
            read = results["reads"][name]
            ok = read["p95_target_met"] and read["ratio_target_met"]
            met = met and ok
            log(f"TARGET {name}: p95 {read['p95_ms']} ms (< {P95_TARGET_MS:.0f}: "
                f"{'met' if read['p95_target_met'] else 'MISSED'}), ratio over the rollup {read['ratio_over_rollup']} "
                f"(<= {RATIO_TARGET}: {'met' if read['ratio_target_met'] else 'MISSED'}); p50 {read['p50_ms']} ms: "
                f"SQL {read['sql_p50_ms']}, Python {read['python_p50_ms']}, {read['queries']} queries")  # fmt: skip
        results_write("policy_evidence", {"args": vars(args), "load_seconds": round(loaded, 1), **results,
                                          "targets_met": met})  # fmt: skip
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep_database:
            bench_flows.database(create=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

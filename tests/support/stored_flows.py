"""Flow evidence written straight into a site's database, for end-to-end tests whose subject is reading a
lot of it (not ingesting it: that has tests of its own). As the benchmarks load theirs: one COPY per
table, each window listed as not summed yet (as ingestion lists it), so the rollup's reads find every
row whether serve's housekeeping has summed it or not.

    load_observed_flows(site, keys_per_workload=160, apps=20)

Every enrolled workload gets the label `app=svc-<n>` (n = its place in host-name order, modulo `apps`)
and one one-minute window, two minutes ago, of `keys_per_workload` keys decided `observed` (peers
outside the fleet, 192.0.0.0/16, on seven tcp ports): what a fleet in `visibility` reports, and what
`POST /policies/suggestions` learns from. Runs `python -m tests.support.stored_flows` with the site's
storage, so Django is set up on the site's own database (its partitions made as ingestion makes them).
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta

PORTS = 7


def load_observed_flows(site, *, keys_per_workload: int, apps: int = 20) -> int:
    """Returns the number of group rows (keys) written."""
    from tests.support.serve_process import REPO, _server_env

    env = _server_env(site.database_url, {"PALISADE_DATA_DIR": str(site.data_dir)})
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.stored_flows", "--keys", str(keys_per_workload), "--apps", str(apps)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"loading flow evidence failed:\n{done.stderr}")
    return int(done.stdout.strip())


def suggestion_request() -> dict:
    """`POST /policies/suggestions`' body over every workload's stored minute, by `app`."""
    now = datetime.now(UTC).replace(microsecond=0)
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    return {
        "label_keys": ["app"],
        "from": text(now - timedelta(minutes=10)),
        "to": text(now + timedelta(minutes=1)),
    }


def _load(keys: int, apps: int) -> int:
    from django.db import connection, transaction

    from flows.partitions import flow_partitions_ensure

    start = (datetime.now(UTC) - timedelta(minutes=2)).replace(second=0, microsecond=0)
    end = start + timedelta(minutes=1)
    flow_partitions_ensure(days={start.date(), end.date()})
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM fleet_workload ORDER BY hostname")
        workloads = [row[0] for row in cursor.fetchall()]
    windows, groups, unsummed = io.StringIO(), io.StringIO(), io.StringIO()
    at, to, now = start.isoformat(), end.isoformat(), datetime.now(UTC).isoformat()
    for workload in workloads:
        window = uuid.uuid4()
        windows.write(f"{window}\t{workload}\t{at}\t{to}\tv-loaded\tf\t{now}\n")
        unsummed.write(f"{window}\t{workload}\t{at}\t{keys}\n")
        for k in range(keys):
            peer = f"192.0.{k // 256 % 256}.{k % 256}"
            groups.write(
                f"{window}\t{workload}\t{at}\t{to}\t{peer}\t\\N\ttcp\t{8000 + k % PORTS}\tobserved\t\\N"
                f"\t{k % 5 + 1}\t{at}\t{at}\t0\t0\n"
            )
    with transaction.atomic(), connection.cursor() as cursor:
        for index, workload in enumerate(workloads):
            cursor.execute(
                "UPDATE fleet_workload SET labels = %s, flow_window_seconds_longest = 60 WHERE id = %s",
                [f'{{"app": "svc-{index % apps}"}}', workload],
            )
        copies = (
            ('flows_flowwindow (id, workload_id, start, "end", policy_version, accounting, received_at)', windows),
            ('flows_flowgroup (window_id, workload_id, start, "end", peer, peer_workload_id, protocol, port, '
             "decision, rule_number, connection_count, first_seen, last_seen, bytes_in, bytes_out)", groups),
            ("flows_unsummedwindow (window_id, workload_id, start, keys)", unsummed),
        )  # fmt: skip
        raw = cursor.cursor  # psycopg's own cursor, for COPY
        for table, rows in copies:
            with raw.copy(f"COPY {table} FROM STDIN") as copy:
                copy.write(rows.getvalue())
        cursor.execute("ANALYZE")
    return len(workloads) * keys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, required=True)
    parser.add_argument("--apps", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    print(_load(args.keys, args.apps))


if __name__ == "__main__":
    main()

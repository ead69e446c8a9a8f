"""A real Prometheus scrapes the real serve over TLS with an operator token, as docs/metrics.md tells
an operator to set it up, and what it stores is what the operator API says: the workloads by sync
state are GET /workloads/counts' figures. Agents speaking the real stream protocol put five workloads
in five states; `promtool check metrics` finds nothing to say of the exposition."""

from __future__ import annotations

import math
import ssl
import time

import httpx
import pytest

from agent import protocol
from agent.enrol import enrol
from agent.flowbuffer import gap_record, window_record
from agent.flowreport import report_body
from agent.flowwindow import FlowKey, Windows
from agent.state import StateDir
from tests.support.flow_reports import post_flow_report
from tests.support.prometheus import PrometheusServer, check_metrics
from tests.support.scripted_agent import ScriptedStreams
from tests.support.serve_process import Site, pinned_context

pytestmark = pytest.mark.e2e

ROLES = ("synced", "degraded", "pending", "removed")


def _vector(prometheus: PrometheusServer, expr: str, label: str | None = None) -> dict:
    return {
        (sample["metric"].get(label) if label else None): float(sample["value"][1])
        for sample in prometheus.query(expr)
    }


def _exposed(operator) -> dict[str, float]:
    """The exposition's samples by name and labels, as the text format writes them."""
    text = operator.get("/metrics", headers={"Accept": "text/plain"}).text
    return {
        line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _report_body() -> bytes:
    now = time.time()
    windows = Windows(length=60, max_keys=100, accounting=False)
    windows.connection_opened(FlowKey("10.70.0.2", "tcp", 443, "observed", None), now - 120)
    closed, gaps = windows.close_due(math.inf, "v-metrics")
    records = [window_record(window) for window in closed], [gap_record(gap) for gap in gaps]
    return report_body(*records, now=now, process_start_id="p1", uptime_seconds=300.0, window_seconds=60)


def test_prometheus_scrapes_serve_and_stores_what_the_counts_say(tmp_path):
    root = tmp_path
    with Site.fresh(root / "data", migrated=True) as site:
        serve = site.serve()
        token = serve.mint_operator_token("prometheus")
        operator = serve.client("operator", headers={"Authorization": f"Bearer {token}"})
        bundle = operator.post(
            "/api/v1/provisioning-tokens", json={"description": "metrics", "max_uses": 5}
        ).json()["bundle"]
        for n, name in enumerate((*ROLES, "never-connected")):
            enrol(bundle, str(root / name), hostname=name, addresses=[f"10.70.0.{n + 1}"])
        streams = ScriptedStreams()
        try:
            for role in ROLES:
                streams.hold(StateDir(root / role).load_enrolment(), role=role)
            counts = operator.get("/api/v1/workloads/counts").json()
            assert counts == {
                "total": 5,
                "sync_state": {"synced": 1, "pending": 1, "degraded": 1, "offline": 1},
                "removed": 1,
            }

            # A flow report lands; one tampered with after signing is refused once read, one whose
            # credential header is not the workload's is refused before its body is read.
            agent = StateDir(root / "synced").load_enrolment()
            before = _exposed(operator)
            body = _report_body()
            assert post_flow_report(serve, agent, body).status_code == 200
            assert (
                post_flow_report(serve, agent, body, sent=body.replace(b"10.70", b"10.71")).status_code == 401
            )
            wrong = {protocol.HEADER_CREDENTIAL: "not-the-credential"}
            assert post_flow_report(serve, agent, body, **wrong).status_code == 401
            moved = {name: value - before.get(name, 0.0) for name, value in _exposed(operator).items()}
            assert moved["palisade_flow_reports_ingested_total"] == 1
            assert moved["palisade_flow_windows_ingested_total"] == 1
            assert moved["palisade_flow_group_rows_ingested_total"] == 1
            assert moved['palisade_flow_reports_refused_total{reason="unauthenticated"}'] == 2
            assert moved['palisade_http_responses_total{listener="gateway",status_class="4xx"}'] == 2
            assert moved['palisade_http_responses_total{listener="gateway",status_class="2xx"}'] == 1

            # The exposition, as Prometheus's text format parser and linter read it.
            exposition = operator.get("/metrics", headers={"Accept": "text/plain"})
            assert exposition.status_code == 200
            check_metrics(exposition.text)
            refused = operator.get("/metrics", headers={"Authorization": "Bearer pal_op_wrong"})
            assert refused.status_code == 401 and refused.json()["type"].endswith(":unauthenticated")

            # Prometheus trusts exactly the certificate serve presents, and sends the token.
            certificate = root / "operator-cert.pem"
            certificate.write_text(ssl.DER_cert_to_PEM_cert(serve.served_certificate("operator")))
            host, port = serve.address("operator")
            job = {
                "scheme": "https",
                "tls_config": {"ca_file": str(certificate)},
                "static_configs": [{"targets": [f"{host}:{port}"]}],
            }
            scrape = [
                {"job_name": "palisade", "authorization": {"credentials": token}, **job},
                {"job_name": "no-token", **job},
            ]
            with PrometheusServer(root / "prometheus", scrape=scrape) as prometheus:
                seen = prometheus.wait_for(
                    lambda: _vector(
                        prometheus, 'palisade_workloads_by_sync_state{job="palisade"}', "sync_state"
                    ),
                    timeout=60,
                    what="the workloads-by-sync-state series",
                )
                assert seen == {state: float(n) for state, n in counts["sync_state"].items()}
                assert _vector(prometheus, 'palisade_workloads_enforcement_removed{job="palisade"}') == {
                    None: counts["removed"]
                }
                assert _vector(prometheus, 'palisade_workloads{job="palisade"}') == {None: counts["total"]}
                up = prometheus.wait_for(
                    lambda: len(_vector(prometheus, "up", "job")) == 2 and _vector(prometheus, "up", "job"),
                    what="both jobs scraped",
                )
                assert up == {"palisade": 1.0, "no-token": 0.0}
                health = [w["health"] for w in operator.get("/api/v1/workloads").json()["items"]]
                assert (
                    _vector(prometheus, 'palisade_workloads_telemetry_live{job="palisade"}')
                    == {None: sum(h["telemetry_live"] for h in health)}
                    == {None: 1}
                )
                (without_token,) = [t for t in prometheus.targets() if t["labels"]["job"] == "no-token"]
                assert "401" in without_token["lastError"], without_token
                # This process's own figures: the streams it holds, the acknowledgements it timed
                # (synced and removed acknowledged their first version), its housekeeping.
                assert _vector(prometheus, 'palisade_streams_held{job="palisade"}') == {None: 4.0}
                acknowledged = _vector(
                    prometheus, 'palisade_policy_acknowledgement_seconds_count{job="palisade"}'
                )
                assert acknowledged == {None: 2.0}
                prometheus.wait_for(
                    lambda: _vector(
                        prometheus,
                        'palisade_housekeeping_last_success_timestamp_seconds{job="palisade",step="streams_catch_up"} > 0',
                    ),
                    what="the stream sweep's first success",
                )
        finally:
            streams.close()
        # Not on the agent gateway: its listener serves agent paths only.
        der = serve.served_certificate("gateway")
        with httpx.Client(base_url=serve.gateway_url, verify=pinned_context(der), timeout=30) as gateway:
            assert gateway.get("/metrics", headers={"Authorization": f"Bearer {token}"}).status_code == 404
        operator.close()
        assert serve.stop() == 0
        assert "Traceback" not in serve.stderr_text()

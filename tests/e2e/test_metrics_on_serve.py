"""A real Prometheus scrapes the real serve over TLS with an operator token, as docs/metrics.md tells
an operator to set it up, and what it stores is what the operator API says: the workloads by sync
state are GET /workloads/counts' figures. Agents speaking the real stream protocol put five workloads
in five states; `promtool check metrics` finds nothing to say of the exposition."""

from __future__ import annotations

import ssl

import httpx
import pytest

from agent.enrol import enrol
from agent.state import StateDir
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


def test_prometheus_scrapes_serve_and_stores_what_the_counts_say(tmp_path):
    root = tmp_path
    with Site.fresh(root / "data") as site:
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
                assert _vector(prometheus, "up", "job") == {"palisade": 1.0, "no-token": 0.0}
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

"""Flow evidence over both address families and ICMP, with a peer that is itself a workload of the
fleet: a real agent in a namespace, the real serve, counts through `/flows/rollup` equal to the
connections made."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from tests.support.lab import TCP_SERVER, AgentProcess, NamespacedServe, probe
from tests.support.netns import Lab, require_namespace_lab

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(600)]

CP = "10.87.0.1"
WEB, WEB6 = "10.87.0.11", "fd87::11"
CLIENT, CLIENT6 = "10.87.0.12", "fd87::12"
OVER_V4, OVER_V6 = 2, 3


@pytest.fixture
def lab():
    require_namespace_lab()
    with Lab.create({"cp": (CP, None), "web": (WEB, WEB6), "client": (CLIENT, CLIENT6)}) as lab:
        servers = lab.popen_python("web", TCP_SERVER6, "8080")
        assert servers.stdout.readline().strip() == "ready"
        yield lab
        servers.kill()
        servers.wait(10)


# TCP_SERVER on a dual-stack socket: IPv4 clients arrive as ::ffff:a.b.c.d.
TCP_SERVER6 = TCP_SERVER.replace(
    "socket.AF_INET, socket.SOCK_STREAM", "socket.AF_INET6, socket.SOCK_STREAM"
).replace('"0.0.0.0"', '"::"')


def test_ipv6_ipv4_and_icmp_connections_are_counted_with_the_peer_workload(lab, tmp_path):
    serve = NamespacedServe(
        lab, "cp", tmp_path / "cp", operator_listen=f"{CP}:8080", gateway_listen=f"{CP}:8443", migrated=True
    ).start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    try:
        api = serve.api(serve.mint_operator_token("peers"))

        def bundle() -> str:
            return api.post("/provisioning-tokens", {"description": "peers", "max_uses": 1}).json()["bundle"]

        web_id = web.enrol(bundle(), WEB, WEB6)
        # The client is a workload of the fleet too (enrolled, its agent not running): its addresses
        # make it the peer workload of what it sends.
        client_id = AgentProcess(lab, "client", tmp_path / "client").enrol(bundle(), CLIENT, CLIENT6)
        api.request(
            "PUT", f"/workloads/{web_id}/labels", json={"labels": {"app": "web"}}, headers={"If-Match": '"1"'}
        )
        created = api.post("/rulesets", {"name": "web", "scope": "app=web", "rules": [
            {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 8080}]}]})  # fmt: skip
        assert created.status_code == 201, created.text
        rule = created.json()["rules"][0]
        changed = api.post("/mode-changes", {"selection": {"workload_ids": [web_id]}, "mode": "simulation"})
        assert changed.status_code == 202, changed.text
        web.start("--flow-window-seconds", "2")
        api.wait_converged(web_id)
        # Traffic starts on a window boundary after the mode change: a range from there holds every
        # window of it, and the workload was in simulation for all of that range.
        boundary = (int(time.time()) // 2 + 1) * 2
        time.sleep(boundary - time.time() + 0.05)
        began = datetime.fromtimestamp(boundary, UTC)

        for _ in range(OVER_V4):
            assert probe(lab, "client", WEB, 8080) == "open"
        for _ in range(OVER_V6):
            assert probe(lab, "client", WEB6, 8080) == "open"
        # One echo each: admitted in simulation, and would be blocked (no rule admits ICMP).
        for command in (
            ["ping", "-4", "-c", "1", "-W", "2", WEB],
            ["ping", "-6", "-c", "1", "-W", "2", WEB6],
        ):
            assert lab.run("client", command).returncode == 0

        expected = {
            (CLIENT, client_id, "tcp", 8080, "allowed", rule["id"]): OVER_V4,
            (CLIENT6, client_id, "tcp", 8080, "allowed", rule["id"]): OVER_V6,
            (CLIENT, client_id, "icmp", 0, "would_block", None): 1,
            (CLIENT6, client_id, "icmpv6", 0, "would_block", None): 1,
        }

        def counted():
            end = (datetime.now(UTC) + timedelta(seconds=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
            page = api.get(
                "/flows/rollup",
                params={
                    "workload": web_id,
                    "group_by": ["peer", "peer_workload", "service", "decision", "rule"],
                    "from": began.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "to": end,
                },
            )
            found = {
                (g["peer"], g["peer_workload_id"], g["service"]["protocol"], g["service"]["port"],
                 g["decision"], g["rule_id"]): g["connection_count"]
                for g in page["items"]
            }  # fmt: skip
            return found if found == expected else None

        try:
            api.wait_for("the rollup to equal the connections made", counted, timeout=60)
        except AssertionError as error:
            raise AssertionError(f"{error}; expected {expected}") from None

        # The review before enforcing names exactly what enforcement would block, and fails on it. The
        # windows are counted before the agent's next heartbeat says it holds nothing more of the range
        # (flow_backlog_since): until then the review also fails on evidence not delivered yet.
        to = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

        def reviewed():
            review = api.get(
                "/flows/review",
                params={"workload": web_id, "from": began.strftime("%Y-%m-%dT%H:%M:%SZ"), "to": to},
            )
            return None if any("not delivered yet" in reason for reason in review["reasons"]) else review

        review = api.wait_for("the agent's evidence of the range to be delivered", reviewed, timeout=30)
        assert review["verdict"] == "fail"
        assert review["reasons"] == ["2 would-block groups: enforcing would block them"], review
        assert sorted(
            (g["peer"], g["service"]["protocol"], g["connection_count"]) for g in review["would_block"]
        ) == [(CLIENT, "icmp", 1), (CLIENT6, "icmpv6", 1)]
    finally:
        web.kill()
        assert serve.stop() == 0
    assert "Traceback" not in web.log(), web.log()

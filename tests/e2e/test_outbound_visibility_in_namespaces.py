"""Outbound visibility and the gateway sets with a real agent, the real serve and traffic (root only).

A workload whose outbound mode is `visibility` (the default) gets a document with no output chain, byte
for byte what it was before outbound existed; its agent adds an observe-only one
(agent/outbound_observe.py). Connecting out N times to a stranger is N outbound `observed` connections to
the stranger's port, every inbound answer is the inbound traffic's alone, and nothing is refused.

A changed list of gateways reaches the kernel's gateway sets at once, with no new policy version, while
the workload holds an enforced outbound table.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from tests.support.lab import TCP_SERVER, AgentProcess, NamespacedServe, probe
from tests.support.netns import Lab, require_namespace_lab

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(600)]

CP, WEB, CLIENT, STRANGER = "10.93.0.1", "10.93.0.11", "10.93.0.12", "10.93.0.13"
OUT_TO_STRANGER, IN_FROM_CLIENT, OUT_TO_CLOSED = 7, 4, 3


@pytest.fixture
def lab():
    require_namespace_lab()
    hosts = {"cp": (CP, None), "web": (WEB, None), "client": (CLIENT, None), "stranger": (STRANGER, None)}
    with Lab.create(hosts) as lab:
        servers = [lab.popen_python(ns, TCP_SERVER, "8080", "9090") for ns in ("web", "stranger")]
        try:
            for server in servers:
                assert server.stdout.readline().strip() == "ready"
            yield lab
        finally:
            for server in servers:
                server.kill()
                server.wait(10)


def _text(instant: datetime) -> str:
    return instant.strftime("%Y-%m-%dT%H:%M:%SZ")


def _totals(api, workload_id: str, began: datetime, **params) -> dict:
    totals: dict = {}
    end = datetime.now(UTC) + timedelta(seconds=5)
    query = {"workload": workload_id, "from": _text(began), "to": _text(end), "limit": 500, **params}
    for window in api.get("/flows", params=query)["items"]:
        for group in window["groups"]:
            key = (group["peer"], group["protocol"], group["port"], group["decision"], group["rule_id"],
                   group.get("direction"))  # fmt: skip
            totals[key] = totals.get(key, 0) + group["connection_count"]
    return totals


def _enrolled(serve: NamespacedServe, agent: AgentProcess, address: str) -> tuple:
    api = serve.api(serve.mint_operator_token("outbound-visibility"))
    bundle = api.post("/provisioning-tokens", {"description": "ov", "max_uses": 1}).json()["bundle"]
    return api, agent.enrol(bundle, address)


def test_a_visibility_workload_records_its_outgoing_connections_observed_and_nothing_else_changes(
    lab, tmp_path
):
    serve = NamespacedServe(
        lab, "cp", tmp_path / "cp", operator_listen=f"{CP}:8080", gateway_listen=f"{CP}:8443", migrated=True
    )
    serve.start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    try:
        api, web_id = _enrolled(serve, web, WEB)
        web.start("--flow-window-seconds", "2")
        workload = api.wait_converged(web_id)
        assert (workload["mode"], workload["outbound_mode"]) == ("visibility", "visibility")
        rendered = api.get(f"/workloads/{web_id}/rendered-policy")["document"]
        assert "chain output" not in rendered  # the document is what it was before outbound existed
        table = lab.run("web", ["nft", "list", "chain", "inet", "palisade", "output"])
        assert table.returncode == 0 and "ct mark set 0x81000000 accept" in table.stdout, table.stderr
        assert "drop" not in table.stdout
        began = datetime.now(UTC) - timedelta(seconds=5)

        for _ in range(OUT_TO_STRANGER):
            assert probe(lab, "web", STRANGER, 9090) == "open"
        for _ in range(OUT_TO_CLOSED):  # refused by the stranger, not by the table: still connections opened
            assert probe(lab, "web", STRANGER, 7070) == "closed"
        for _ in range(IN_FROM_CLIENT):
            assert probe(lab, "client", WEB, 8080) == "open"

        outbound = {
            (STRANGER, "tcp", 9090, "observed", None, "outbound"): OUT_TO_STRANGER,
            (STRANGER, "tcp", 7070, "observed", None, "outbound"): OUT_TO_CLOSED,
        }
        inbound = {(CLIENT, "tcp", 8080, "observed", None, None): IN_FROM_CLIENT}
        api.wait_for(
            f"the outbound windows to add up to {outbound}",
            lambda: _totals(api, web_id, began, direction="outbound") == outbound,
            timeout=60,
        )
        api.wait_for("the inbound windows", lambda: _totals(api, web_id, began) == inbound, timeout=30)
        assert _totals(api, web_id, began, direction="inbound") == inbound
        span = {
            "workload": web_id,
            "from": _text(began),
            "to": _text(datetime.now(UTC) + timedelta(seconds=5)),
        }
        rollup = api.get("/flows/rollup", params={**span, "group_by": ["peer", "service", "decision"]})
        assert [(r["service"]["port"], r["decision"], r["connection_count"]) for r in rollup["items"]] == [
            (8080, "observed", IN_FROM_CLIENT)
        ]
        assert api.get("/flows/gaps", params=span)["items"] == []
        # Its own stream and flow reports to the control plane are not evidence (the baseline's gateways).
        assert not any(key[0] == CP for key in _totals(api, web_id, began, direction="any"))
        after = api.workload(web_id)
        assert after["applied_version"] == workload["applied_version"] == after["latest_version"]
    finally:
        web.kill()
        assert serve.stop() == 0
    assert "Traceback" not in web.log(), web.log()


def _gateway_set(lab: Lab) -> set[str]:
    listed = lab.run("web", ["nft", "list", "set", "inet", "palisade", "agent_gateways_v4"])
    assert listed.returncode == 0, listed.stderr
    return set(re.findall(r"(\d+\.\d+\.\d+\.\d+ \. \d+)", listed.stdout))


def test_a_changed_list_of_gateways_is_in_the_kernels_gateway_set_without_a_new_version(lab, tmp_path):
    def serve_with(*advertised: str) -> NamespacedServe:
        args = [arg for gateway in advertised for arg in ("--gateway-advertise", gateway)]
        return NamespacedServe(
            lab,
            "cp",
            tmp_path / "cp",
            args,
            operator_listen=f"{CP}:8080",
            gateway_listen=f"{CP}:8443",
            migrated=True,
        ).start()

    serve = serve_with(f"{CP}:8443")
    web = AgentProcess(lab, "web", tmp_path / "web")
    try:
        api, web_id = _enrolled(serve, web, WEB)
        web.start()
        api.wait_converged(web_id)
        change = api.post(
            "/mode-changes",
            {"selection": {"workload_ids": [web_id]}, "mode": "enforced", "direction": "outbound"},
        )
        assert change.status_code == 202, change.text
        enforced = api.wait_converged(web_id)
        assert "chain output" in api.get(f"/workloads/{web_id}/rendered-policy")["document"]
        assert _gateway_set(lab) == {f"{CP} . 8443"}
        assert probe(lab, "web", STRANGER, 9090) == "closed"  # enforced: no rule admits it

        # The control plane's list changes (a serve started with another --gateway-advertise list): the
        # agent hears it over its stream and its table's set holds the new gateway, the version unchanged.
        assert serve.stop() == 0
        serve = serve_with(f"{CP}:8443", f"{CP}:9443")
        api = serve.api(serve.mint_operator_token("outbound-visibility-2"))
        api.wait_for(
            "the new gateway in the kernel's set", lambda: f"{CP} . 9443" in _gateway_set(lab), timeout=60
        )
        assert _gateway_set(lab) == {f"{CP} . 8443", f"{CP} . 9443"}
        after = api.wait_converged(web_id)
        assert after["applied_version"] == enforced["applied_version"] == after["latest_version"]
        assert "gateway sets applied" in web.log()
        assert probe(lab, "web", STRANGER, 9090) == "closed"  # the rest of the table as it was
    finally:
        web.kill()
        assert serve.stop() == 0
    assert "Traceback" not in web.log(), web.log()

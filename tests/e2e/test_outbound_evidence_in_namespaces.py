"""Outbound evidence end to end, before the renderer writes outbound chains: a hand-written nftables
table of its own in the workload's namespace marks its outgoing connections as the renderer will (the
mark's 0x80 flag, 0x40 for the fail-safe list, and an NFLOG drop with the `palisade:out` prefix). The
real agent counts them beside the inbound connections that its own table (from the control plane)
marks, reports both to the real serve, and the operator API shows outbound windows whose counts equal
the traffic, while every inbound answer is exactly the inbound traffic's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tests.support.lab import TCP_SERVER, AgentProcess, NamespacedServe, probe
from tests.support.netns import Lab, require_namespace_lab

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(600)]

CP, WEB, CLIENT = "10.91.0.1", "10.91.0.11", "10.91.0.12"
IN_ADMITTED, IN_WOULD_BLOCK = 4, 3
OUT_ADMITTED, OUT_BLOCKED, OUT_DNS = 5, 2, 6
OUTBOUND, FAILSAFE = 0x80, 0x40
ALLOWED, BLOCKED = 2, 4

# Datagrams to udp/53, each from a socket of its own: one connection each.
_DNS = """
import socket, sys
for _ in range(int(sys.argv[2])):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"q", (sys.argv[1], 53))
"""


def _outbound_table(rule_number: int) -> str:
    """What the renderer's output chain will do, for connections to the client only (the agent's own
    stream to the gateway is left unmarked: it is not what this test counts). Priority 10: after the
    observe-only output chain the agent adds to its table in outbound visibility (priority 0), so that
    these marks are the last set and these drops drop."""

    def mark(flags: int, decision: int, rule: int = 0) -> str:
        return f"{(flags | decision) << 24 | rule:#010x}"

    return (
        "table inet palisade_outbound_test {\n"
        "\tchain output {\n"
        "\t\ttype filter hook output priority 10; policy accept;\n"
        "\t\tct state established,related accept\n"
        f"\t\tct state new ip daddr {CLIENT} udp dport 53 ct mark set {mark(OUTBOUND | FAILSAFE, ALLOWED)} accept\n"
        f"\t\tct state new ip daddr {CLIENT} tcp dport 8080 ct mark set {mark(OUTBOUND, ALLOWED, rule_number)} accept\n"
        f"\t\tct state new ip daddr {CLIENT} tcp dport 9090 ct mark set {mark(OUTBOUND, BLOCKED)} "
        'log prefix "palisade:out" group 7302 drop\n'
        "\t}\n}\n"
    )


@pytest.fixture
def lab():
    require_namespace_lab()
    with Lab.create({"cp": (CP, None), "web": (WEB, None), "client": (CLIENT, None)}) as lab:
        servers = [lab.popen_python(ns, TCP_SERVER, "8080", "9090") for ns in ("web", "client")]
        for server in servers:
            assert server.stdout.readline().strip() == "ready"
        yield lab
        for server in servers:
            server.kill()
            server.wait(10)


def _text(instant: datetime) -> str:
    return instant.strftime("%Y-%m-%dT%H:%M:%SZ")


def _totals(api, web_id: str, began: datetime, **params) -> dict:
    totals: dict = {}
    end = datetime.now(UTC) + timedelta(seconds=5)
    query = {"workload": web_id, "from": _text(began), "to": _text(end), "limit": 500, **params}
    for window in api.get("/flows", params=query)["items"]:
        for group in window["groups"]:
            key = (group["peer"], group["protocol"], group["port"], group["decision"], group["rule_id"],
                   group.get("direction"), group.get("failsafe"))  # fmt: skip
            totals[key] = totals.get(key, 0) + group["connection_count"]
    return totals


def test_outbound_windows_count_the_traffic_and_leave_every_inbound_answer_as_it_was(lab, tmp_path):
    serve = NamespacedServe(
        lab, "cp", tmp_path / "cp", operator_listen=f"{CP}:8080", gateway_listen=f"{CP}:8443", migrated=True
    )
    serve.start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    try:
        api = serve.api(serve.mint_operator_token("outbound"))
        bundle = api.post("/provisioning-tokens", {"description": "ob", "max_uses": 1}).json()["bundle"]
        web_id = web.enrol(bundle, WEB)
        api.request(
            "PUT", f"/workloads/{web_id}/labels", json={"labels": {"app": "web"}}, headers={"If-Match": '"1"'}
        )
        created = api.post("/rulesets", {"name": "web", "scope": "app=web", "rules": [
            {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 8080}]}]})  # fmt: skip
        assert created.status_code == 201, created.text
        rule = created.json()["rules"][0]
        web.start("--flow-window-seconds", "2")
        api.wait_converged(web_id)
        change = api.post("/mode-changes", {"selection": {"workload_ids": [web_id]}, "mode": "simulation"})
        assert change.status_code == 202, change.text
        api.wait_converged(web_id)
        applied = lab.run("web", ["nft", "-f", "-"], input=_outbound_table(rule["number"]))
        assert applied.returncode == 0, applied.stderr
        began = datetime.now(UTC) - timedelta(seconds=5)

        for _ in range(IN_ADMITTED):
            assert probe(lab, "client", WEB, 8080) == "open"
        for _ in range(IN_WOULD_BLOCK):
            assert probe(lab, "client", WEB, 9090) == "open"
        for _ in range(OUT_ADMITTED):
            assert probe(lab, "web", CLIENT, 8080) == "open"
        for _ in range(OUT_BLOCKED):  # each retransmits its SYN: one attempt, several packets logged
            assert probe(lab, "web", CLIENT, 9090) == "closed"
        assert lab.python("web", _DNS, CLIENT, str(OUT_DNS)).returncode == 0

        inbound = {
            (CLIENT, "tcp", 8080, "allowed", rule["id"], None, None): IN_ADMITTED,
            (CLIENT, "tcp", 9090, "would_block", None, None, None): IN_WOULD_BLOCK,
        }
        outbound = {
            (CLIENT, "tcp", 8080, "allowed", rule["id"], "outbound", False): OUT_ADMITTED,
            (CLIENT, "tcp", 9090, "blocked", None, "outbound", False): OUT_BLOCKED,
            (CLIENT, "udp", 53, "allowed", None, "outbound", True): OUT_DNS,
        }
        api.wait_for(
            f"the outbound windows to add up to {outbound}",
            lambda: _totals(api, web_id, began, direction="outbound") == outbound,
            timeout=60,
        )
        assert _totals(api, web_id, began) == inbound
        assert _totals(api, web_id, began, direction="inbound") == inbound
        both = _totals(api, web_id, began, direction="any")
        assert both == {
            **{(*key[:5], "inbound", False): count for key, count in inbound.items()},
            **outbound,
        }

        span = {
            "workload": web_id,
            "from": _text(began),
            "to": _text(datetime.now(UTC) + timedelta(seconds=5)),
        }
        rollup = api.get("/flows/rollup", params={**span, "group_by": ["peer", "service", "decision"]})
        assert {(r["service"]["port"], r["decision"]): r["connection_count"] for r in rollup["items"]} == {
            (8080, "allowed"): IN_ADMITTED, (9090, "would_block"): IN_WOULD_BLOCK,
        }  # fmt: skip
        by_rule = api.get("/flows/rollup", params={**span, "group_by": ["rule"]})
        assert {r["rule_id"]: r["connection_count"] for r in by_rule["items"]} == {
            rule["id"]: IN_ADMITTED, None: IN_WOULD_BLOCK,
        }  # fmt: skip
        review = api.get("/flows/review", params=span)
        assert [(w["service"]["port"], w["connection_count"]) for w in review["would_block"]] == [
            (9090, IN_WOULD_BLOCK)
        ]
        outbound_review = api.get("/flows/review", params={**span, "direction": "outbound"})
        assert outbound_review["would_block"] == []
        gaps = api.get("/flows/gaps", params=span)
        assert gaps["items"] == [] and gaps == api.get("/flows/gaps", params={**span, "direction": "any"})
    finally:
        web.kill()
        assert serve.stop() == 0
    assert "Traceback" not in web.log(), web.log()

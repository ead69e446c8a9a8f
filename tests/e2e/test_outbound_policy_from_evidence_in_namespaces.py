"""Outbound policy from evidence end to end (root only): a real agent on an `app=api` workload whose
outbound mode is `simulation` records the connections it opens (to a database of the fleet on tcp/5432,
which the database's inbound rule admits, and tcp/6379, which nothing admits; to an address outside the
fleet on tcp/9090); through the real serve, the outbound suggestion proposes exactly the two rules
nothing admits (the database's 6379 as a selector, the outside address as a group of exactly it) and
not 5432 (one rule, both ends); the impact of the draft refuses nothing newly; saved unchanged and put
in `enforced`, the kernel admits the same traffic again, each connection by the rule the suggestion
proposed or the database's inbound rule, and refuses a destination port never seen."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime

import pytest

from tests.support.lab import TCP_SERVER, AgentProcess, NamespacedServe, probe
from tests.support.netns import Lab, require_namespace_lab

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(600)]

CP, API, DB, OUTSIDE = "10.88.0.1", "10.88.0.11", "10.88.0.12", "10.88.0.13"
WINDOW = 2  # the agent's flow window, seconds
# One round: connections the api workload opens, per (destination, port).
ROUND = {(DB, 5432): 3, (DB, 6379): 2, (OUTSIDE, 9090): 4}

CONNECT = """
import socket, sys
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(count):
    c = socket.create_connection((host, port), timeout=5)
    assert c.recv(2) == b"hi", "no greeting"
    c.close()
print("done", flush=True)
"""


@pytest.fixture
def lab():
    require_namespace_lab()
    hosts = {"cp": (CP, None), "api": (API, None), "db": (DB, None), "outside": (OUTSIDE, None)}
    with Lab.create(hosts) as lab:
        lab.run("api", ["sysctl", "-qw", "net.netfilter.nf_conntrack_acct=0"])
        servers = [lab.popen_python("db", TCP_SERVER, "5432", "6379"),
                   lab.popen_python("outside", TCP_SERVER, "9090", "9091")]  # fmt: skip
        try:
            for server in servers:
                assert server.stdout.readline().strip() == "ready"
            yield lab
        finally:
            for server in servers:
                server.kill()
                server.wait(10)


def _text(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def _boundary_after(at: float) -> datetime:
    return datetime.fromtimestamp((math.floor(at / WINDOW) + 1) * WINDOW, UTC)


def _next_window() -> datetime:
    boundary = _boundary_after(time.time())
    time.sleep(max(0.0, boundary.timestamp() - time.time()) + 0.05)
    return boundary


def _span(start: datetime, end: datetime) -> dict:
    return {"from": _text(start), "to": _text(end)}


def _round(lab: Lab) -> None:
    for (host, port), count in ROUND.items():
        done = lab.python("api", CONNECT, host, str(port), str(count))
        assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr


def _counted(api, api_id: str, start: datetime, end: datetime, expected: dict) -> None:
    """Waits until the outbound evidence of the range is exactly `expected` ((destination, port,
    decision, rule id) -> connections) and its coverage complete."""
    found: list = [None]

    def counted():
        page = api.get("/flows/rollup", params={
            "workload": api_id, "direction": "outbound", "group_by": ["peer", "service", "decision", "rule"],
            **_span(start, end)})  # fmt: skip
        found[0] = {(g["peer"], g["service"]["port"], g["decision"], g["rule_id"]): g["connection_count"]
                    for g in page["items"]}  # fmt: skip
        return found[0] == expected and page["coverage"]["complete"]

    try:
        api.wait_for("the outbound range to hold the connections made", counted, timeout=60)
    except AssertionError as error:
        raise AssertionError(f"{error}; expected {expected}, found {found[0]}") from None


def _labelled(api, workload_id: str, labels: dict) -> None:
    done = api.request("PUT", f"/workloads/{workload_id}/labels", json={"labels": labels},
                       headers={"If-Match": '"1"'})  # fmt: skip
    assert done.status_code == 200, done.text


def _outbound(api, workload_id: str, mode: str) -> None:
    change = api.post(
        "/mode-changes", {"selection": {"workload_ids": [workload_id]}, "mode": mode, "direction": "outbound"}
    )
    assert change.status_code == 202, change.text
    api.wait_converged(workload_id)


def test_outbound_rules_suggested_from_simulation_admit_the_same_traffic_when_enforced(lab, tmp_path):
    serve = NamespacedServe(
        lab, "cp", tmp_path / "cp", operator_listen=f"{CP}:8080", gateway_listen=f"{CP}:8443", migrated=True
    ).start()
    agent = AgentProcess(lab, "api", tmp_path / "api")
    try:
        api = serve.api(serve.mint_operator_token("outbound evidence"))
        bundle = api.post("/provisioning-tokens", {"description": "e", "max_uses": 2}).json()["bundle"]
        api_id = agent.enrol(bundle, API)
        # The database is a workload of the fleet (its agent need not run: the api's table reads its
        # inbound rule); the outside address is not.
        db_id = AgentProcess(lab, "db", tmp_path / "db").enrol(bundle, DB)
        _labelled(api, api_id, {"app": "api"})
        _labelled(api, db_id, {"app": "db"})
        db_rules = {"name": "db", "scope": "app=db", "rules": [
            {"sources": [{"selector": "app=api"}], "services": [{"protocol": "tcp", "port": 5432}]}]}  # fmt: skip
        inbound = api.post("/rulesets", db_rules)
        assert inbound.status_code == 201, inbound.text
        db_rule = inbound.json()["rules"][0]["id"]
        agent.start("--flow-window-seconds", str(WINDOW))
        api.wait_converged(api_id)
        _outbound(api, api_id, "simulation")

        # 1. Watched in outbound simulation: 5432 admitted at the database's end, the rest would-block.
        start1 = _next_window()
        _round(lab)
        end1 = _boundary_after(time.time() + 1)
        _counted(api, api_id, start1, end1, {
            (DB, 5432, "allowed", db_rule): 3, (DB, 6379, "would_block", None): 2,
            (OUTSIDE, 9090, "would_block", None): 4,
        })  # fmt: skip

        def suggestion():
            answer = api.post("/policies/suggestions", {
                "workload": [api_id], **_span(start1, end1), "label_keys": ["app"], "direction": "outbound"})  # fmt: skip
            assert answer.status_code == 200, answer.text
            return answer.json()

        suggested = api.wait_for("a complete suggestion", lambda: (s := suggestion())["complete"] and s)
        draft = suggested["draft"]
        assert (draft["scope"], draft["direction"]) == ("app=api", "outbound"), draft
        (group,) = suggested["address_groups"]
        assert group["members"] == [OUTSIDE], group
        assert [(r["destinations"], r["services"]) for r in draft["rules"]] == [
            ([{"selector": "app=db"}], [{"protocol": "tcp", "port": 6379}]),
            ([{"address_group": group["name"]}], [{"protocol": "tcp", "port": 9090}]),
        ]  # fmt: skip
        assert [(k["peer"], k["service"]["port"]) for k in suggested["admitted_now"]] == [(DB, 5432)]

        # 2. The impact of the policy with the draft: nothing refused newly, the two keys admitted.
        impact = api.post("/policies/impact", {
            "rulesets": [db_rules, draft], "address_groups": [group], "workload": [api_id],
            "direction": "outbound", **_span(start1, end1)})  # fmt: skip
        assert impact.status_code == 200, impact.text
        impact = impact.json()
        assert impact["newly_refused"] == [], impact
        assert {(k["peer"], k["port"], k["direction"]): k["connection_count"] for k in impact["newly_admitted"]} == {
            (DB, 6379, "outbound"): 2, (OUTSIDE, 9090, "outbound"): 4}  # fmt: skip

        # 3. Saved unchanged and enforced: the same traffic gets through, by the rules saved.
        saved = api.post("/policies/drafts", {"address_groups": [group], "rulesets": [draft]})
        assert saved.status_code == 201, saved.text
        ruleset = api.get(f"/rulesets/{saved.json()['rulesets'][0]['id']}")
        by_port = {r["services"][0]["port"]: r["id"] for r in ruleset["rules"]}
        _outbound(api, api_id, "enforced")
        start2 = _next_window()
        _round(lab)
        end2 = _boundary_after(time.time() + 1)
        _counted(api, api_id, start2, end2, {
            (DB, 5432, "allowed", db_rule): 3, (DB, 6379, "allowed", by_port[6379]): 2,
            (OUTSIDE, 9090, "allowed", by_port[9090]): 4,
        })  # fmt: skip
        # Nothing wider than seen: a port of the outside address never seen is refused.
        assert probe(lab, "api", OUTSIDE, 9091) == "closed"
        assert api.workload(api_id)["sync"]["state"] == "synced"
    finally:
        agent.kill()
        assert serve.stop() == 0
    assert "Traceback" not in agent.log(), agent.log()

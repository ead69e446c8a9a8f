"""Policy from evidence end to end: a real agent on a database server in a namespace counts
scripted connections of known counts (clients labelled `app=web` on tcp/5432, an address outside the
fleet on tcp/22, each connection from its own source port across the ephemeral range), and through the
real serve: the rules suggested from them are exactly the two the traffic needs; saved unchanged and
put in `simulation` they admit the same traffic again and nothing else; and the impact predicted for a
draft that drops a rule is what the kernel then decides.

The range with an evidence gap (suggestion and impact both incomplete, naming the gap) is covered in
process: tests/policy_drafts/test_suggestions.py and tests/policy_drafts/test_policy_impact.py."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from tests.support.lab import TCP_SERVER, AgentProcess, NamespacedServe, via_unix_socket
from tests.support.netns import Lab, require_namespace_lab
from tests.support.serve_process import throwaway_database

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(600)]

CP, DB = "10.86.0.1", "10.86.0.10"
WEB1, WEB2, OUTSIDE = "10.86.0.11", "10.86.0.12", "10.86.0.13"
WINDOW = 2  # the agent's flow window, seconds
# One round of traffic: connections to the server per (client namespace, its address, server port).
ROUND = {("web1", WEB1, 5432): 3, ("web2", WEB2, 5432): 5, ("outside", OUTSIDE, 22): 4}
EPHEMERAL = range(32768, 61000)  # Linux's default ip_local_port_range

# Connects to HOST:PORT once from each SOURCE port given, reads the server's greeting and closes.
CONNECT_FROM_PORTS = """
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
for source in map(int, sys.argv[3:]):
    c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    c.bind(("0.0.0.0", source))
    c.settimeout(5)
    c.connect((host, port))
    assert c.recv(2) == b"hi", "no greeting"
    c.close()
print("done", flush=True)
"""


@pytest.fixture
def lab():
    require_namespace_lab()
    hosts = {"cp": (CP, None), "db": (DB, None), "web1": (WEB1, None), "web2": (WEB2, None),
             "outside": (OUTSIDE, None)}  # fmt: skip
    with Lab.create(hosts) as lab:
        # No byte accounting: a connection's DESTROY then adds nothing to a later window.
        lab.run("db", ["sysctl", "-qw", "net.netfilter.nf_conntrack_acct=0"])
        servers = lab.popen_python("db", TCP_SERVER, "5432", "22", "6379")
        assert servers.stdout.readline().strip() == "ready"
        yield lab
        servers.kill()
        servers.wait(10)


def _source_ports() -> Iterator[int]:
    """Distinct source ports, each next one far from the last, over the whole ephemeral range."""
    for i in itertools.count(1):
        yield EPHEMERAL.start + (i * 7919) % len(EPHEMERAL)  # 7919 is prime to the range's length


def _connect(lab, ns: str, port: int, count: int, ports: Iterator[int]) -> list[int]:
    sources = [next(ports) for _ in range(count)]
    done = lab.python(ns, CONNECT_FROM_PORTS, DB, str(port), *map(str, sources))
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
    return sources


def _round(lab, ports: Iterator[int]) -> list[int]:
    return [s for (ns, _, port), count in ROUND.items() for s in _connect(lab, ns, port, count, ports)]


def _text(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def _boundary_after(at: float) -> datetime:
    """The first window boundary after `at` (windows align to the clock)."""
    return datetime.fromtimestamp((math.floor(at / WINDOW) + 1) * WINDOW, UTC)


def _next_window() -> datetime:
    """Waits for the next window to begin: a range from there holds only what happens from now on."""
    boundary = _boundary_after(time.time())
    time.sleep(max(0.0, boundary.timestamp() - time.time()) + 0.05)
    return boundary


def _range_end() -> datetime:
    """The end of a range that holds the connections just made: a window boundary at least a second
    after them, so that one whose event the agent reads late (a loaded host) is still inside."""
    return _boundary_after(time.time() + 1)


def _span(start: datetime, end: datetime) -> dict:
    return {"from": _text(start), "to": _text(end)}


def _keys(api, db_id: str, start: datetime, end: datetime) -> dict:
    """(peer, port, decision, rule id) -> connections, from the rollup of the range."""
    page = api.get("/flows/rollup", params={"workload": db_id, "group_by": ["peer", "service", "decision", "rule"],
                                            **_span(start, end)})  # fmt: skip
    return {
        (g["peer"], g["service"]["port"], g["decision"], g["rule_id"]): g["connection_count"]
        for g in page["items"]
    }


def _counted(api, db_id: str, start: datetime, end: datetime, expected: dict) -> dict:
    """Waits until the range holds exactly `expected` and its coverage is complete (the last window
    delivered, and a heartbeat since saying that nothing is held back)."""

    def counted():
        keys = _keys(api, db_id, start, end)
        params = {"workload": db_id, "group_by": "decision", **_span(start, end)}
        return keys == expected and api.get("/flows/rollup", params=params)["coverage"]["complete"] and keys

    try:
        return api.wait_for("the range to hold the connections made", counted, timeout=60)
    except AssertionError as error:
        raise AssertionError(f"{error}; expected {expected}, found {_keys(api, db_id, start, end)}") from None


def _enrolled(api, agent: AgentProcess, address: str, labels: dict) -> str:
    bundle = api.post("/provisioning-tokens", {"description": "evidence", "max_uses": 1}).json()["bundle"]
    workload_id = agent.enrol(bundle, address)
    labelled = api.request(
        "PUT", f"/workloads/{workload_id}/labels", json={"labels": labels}, headers={"If-Match": '"1"'}
    )
    assert labelled.status_code == 200, labelled.text
    return workload_id


def _applied(api, db_id: str, change) -> None:
    """Makes `change` (a policy or mode write) and waits until the server's agent applied what it renders."""
    before = api.workload(db_id)["latest_version"]
    change()
    api.wait_for("a new version", lambda: api.workload(db_id)["latest_version"] != before, timeout=30)
    api.wait_converged(db_id)


@pytest.fixture
def database_url():
    """PostgreSQL when the run has it (suggestions and impact sum the evidence in SQL), else SQLite."""
    with throwaway_database(migrated=True) as url:
        yield via_unix_socket(url)


def test_suggested_rules_admit_the_traffic_they_were_learnt_from_and_the_impact_predicts_the_kernel(
    lab, database_url, tmp_path
):
    serve = NamespacedServe(
        lab, "cp", tmp_path / "cp", database_url=database_url,
        operator_listen=f"{CP}:8080", gateway_listen=f"{CP}:8443", migrated=True,
    ).start()  # fmt: skip
    db = AgentProcess(lab, "db", tmp_path / "db")
    ports = _source_ports()
    try:
        api = serve.api(serve.mint_operator_token("evidence"))
        db_id = _enrolled(api, db, DB, {"app": "db"})
        # The clients are workloads of the fleet (enrolled; what they send is counted by the server's
        # agent, so theirs need not run); `outside` is not.
        web_ids = {
            address: _enrolled(api, AgentProcess(lab, ns, tmp_path / ns), address, {"app": "web"})
            for ns, address in (("web1", WEB1), ("web2", WEB2))
        }
        db.start("--flow-window-seconds", str(WINDOW))
        api.wait_converged(db_id)
        assert api.workload(db_id)["mode"] == "visibility"

        # 1. Watched in visibility, then rules suggested from that range.
        start1 = _next_window()
        sources = _round(lab, ports)
        end1 = _range_end()
        _counted(api, db_id, start1, end1, {
            (WEB1, 5432, "observed", None): 3, (WEB2, 5432, "observed", None): 5, (OUTSIDE, 22, "observed", None): 4,
        })  # fmt: skip
        assert len(set(sources)) == 12 and max(sources) - min(sources) > len(EPHEMERAL) // 2

        def suggestion():
            answer = api.post(
                "/policies/suggestions", {"label": ["app=db"], **_span(start1, end1), "label_keys": ["app"]}
            )
            assert answer.status_code == 200, answer.text
            return answer.json()

        # Complete once the heartbeat after the range's last window says nothing is held back.
        suggested = _awaited(api, "a complete suggestion", suggestion, lambda answer: answer["complete"])
        assert suggested["warning"] is None and suggested["incomplete_intervals"] == [], suggested
        assert suggested["coverage"]["complete"] is True
        assert (suggested["not_generalised_count"], suggested["admitted_now_count"]) == (0, 0), suggested
        draft = suggested["draft"]
        assert draft["scope"] == "app=db" and len(draft["rules"]) == 2, draft
        (group,) = suggested["address_groups"]
        assert group["members"] == [OUTSIDE], group
        by_source = {
            (next(iter(r["sources"][0].items())), len(r["sources"])): (r, evidence)
            for r, evidence in zip(draft["rules"], suggested["evidence"][0]["rules"], strict=True)
        }
        assert set(by_source) == {(("selector", "app=web"), 1), (("address_group", group["name"]), 1)}
        selected_rule, selected_evidence = by_source[(("selector", "app=web"), 1)]
        grouped_rule, grouped_evidence = by_source[(("address_group", group["name"]), 1)]
        # The listening ports only: no client's ephemeral port became a service.
        assert selected_rule["services"] == [{"protocol": "tcp", "port": 5432}]
        assert grouped_rule["services"] == [{"protocol": "tcp", "port": 22}]
        assert {(p["peer"], p["peer_workload_id"], p["connection_count"]) for p in selected_evidence["peers"]} == {
            (WEB1, web_ids[WEB1], 3), (WEB2, web_ids[WEB2], 5)}  # fmt: skip
        assert [(p["peer"], p["peer_workload_id"], p["connection_count"]) for p in grouped_evidence["peers"]] == [
            (OUTSIDE, None, 4)]  # fmt: skip
        assert (selected_evidence["connection_count"], grouped_evidence["connection_count"]) == (8, 4)
        assert [(s["port"], s["connection_count"]) for s in selected_evidence["services"]] == [(5432, 8)]
        assert [(s["port"], s["connection_count"]) for s in grouped_evidence["services"]] == [(22, 4)]

        # 2. Saved unchanged, the server in simulation: the same traffic admitted, by the rules saved.
        saved_group = api.post("/address-groups", group)
        assert saved_group.status_code == 201, saved_group.text
        saved = api.post("/rulesets", draft)
        assert saved.status_code == 201, saved.text
        ruleset = saved.json()
        rule_5432, rule_22 = sorted(ruleset["rules"], key=lambda r: -r["services"][0]["port"])
        assert rule_5432["services"][0]["port"] == 5432 and rule_22["services"][0]["port"] == 22
        _applied(api, db_id, lambda: _expect(api.post(
            "/mode-changes", {"selection": {"workload_ids": [db_id]}, "mode": "simulation"}), 202))  # fmt: skip

        start2 = _next_window()
        _round(lab, ports)
        end2 = _range_end()
        _counted(api, db_id, start2, end2, {
            (WEB1, 5432, "allowed", rule_5432["id"]): 3, (WEB2, 5432, "allowed", rule_5432["id"]): 5,
            (OUTSIDE, 22, "allowed", rule_22["id"]): 4,
        })  # fmt: skip
        decisions = api.get(
            "/flows/rollup", params={"workload": db_id, "group_by": "decision", **_span(start2, end2)}
        )
        assert {g["decision"]: g["connection_count"] for g in decisions["items"]} == {"allowed": 12}, (
            decisions
        )
        review = _awaited(
            api, "the review to pass",
            lambda: api.get("/flows/review", params={"workload": db_id, **_span(start2, end2)}),
            lambda answer: answer["verdict"] == "pass",
        )  # fmt: skip
        assert review["reasons"] == [], review
        assert (review["workload_count"], review["would_block_count"]) == (1, 0), review

        # Nothing wider than what was seen: a new service would be blocked, and so would each source on
        # the service that only the other was seen on.
        start3 = end2
        _connect(lab, "web1", 6379, 1, ports)
        _connect(lab, "web1", 22, 1, ports)
        _connect(lab, "outside", 5432, 1, ports)
        end3 = _range_end()
        _counted(api, db_id, start3, end3, {
            (WEB1, 6379, "would_block", None): 1, (WEB1, 22, "would_block", None): 1,
            (OUTSIDE, 5432, "would_block", None): 1,
        })  # fmt: skip

        # 3. A draft without the tcp/5432 rule: its impact over the second range, then the kernel's.
        without_5432 = {
            "name": ruleset["name"], "description": ruleset["description"], "scope": ruleset["scope"],
            "rules": [{"id": rule_22["id"], "description": rule_22["description"], "sources": rule_22["sources"],
                       "services": rule_22["services"]}],
        }  # fmt: skip
        answer = api.post(
            "/policies/impact", {"rulesets": [without_5432], "workload": [db_id], **_span(start2, end2)}
        )
        assert answer.status_code == 200, answer.text
        impact = answer.json()
        assert impact["coverage"]["complete"] is True and impact["newly_admitted"] == [], impact
        predicted = {(k["peer"], k["port"]): k["connection_count"] for k in impact["newly_refused"]}
        assert predicted == {(WEB1, 5432): 3, (WEB2, 5432): 5}, impact
        assert {(k["workload_id"], k["peer_workload_id"], k["rule_now"]["rule_id"], k["rule_draft"])
                for k in impact["newly_refused"]} == {(db_id, web_ids[WEB1], rule_5432["id"], None),
                                                      (db_id, web_ids[WEB2], rule_5432["id"], None)}  # fmt: skip
        assert impact["newly_refused_summary"]["connection_count"] == 8 and impact["keys_classified"] == 3

        replaced = lambda: api.request(  # noqa: E731
            "PUT", f"/rulesets/{ruleset['id']}", json=without_5432, headers={"If-Match": f'"{ruleset["version"]}"'}
        )  # fmt: skip
        _applied(api, db_id, lambda: _expect(replaced(), 200))
        start4 = _next_window()
        _round(lab, ports)
        end4 = _range_end()
        found = _counted(api, db_id, start4, end4, {
            (WEB1, 5432, "would_block", None): 3, (WEB2, 5432, "would_block", None): 5,
            (OUTSIDE, 22, "allowed", rule_22["id"]): 4,
        })  # fmt: skip
        observed = {
            (peer, port): n for (peer, port, decision, _), n in found.items() if decision == "would_block"
        }
        assert observed == predicted
    finally:
        db.kill()
        assert serve.stop() == 0
    assert "Traceback" not in db.log(), db.log()


def _awaited(api, what: str, read, ok) -> dict:
    """Polls read() until ok(answer); fails with the last answer."""
    last: list = [None]

    def poll():
        last[0] = read()
        return ok(last[0]) and last[0]

    try:
        return api.wait_for(what, poll, timeout=30)
    except AssertionError as error:
        raise AssertionError(f"{error}: {last[0]}") from None


def _expect(response, status: int):
    assert response.status_code == status, response.text
    return response

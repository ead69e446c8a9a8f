"""Outbound policy with real agents, the real serve and traffic (root only).

The server's outbound mode in `enforced` with one outbound rule (to a stranger's tcp/9090): it reaches
the stranger there and not the client's 9090; its agent stays synced, is restarted (a new connection
to its gateway, which no rule admits but the gateway set the agent fills does) and receives a later
change. The client's outbound mode in `enforced` with no outbound rule at all: it reaches the server's
8080 (the server's inbound rule admits it: one rule, both ends) and not the stranger; in `simulation`
it reaches the stranger, and the connection's mark says would_block, outbound.
"""

from __future__ import annotations

import re

import pytest

from policy.renderer import decode_any_mark
from tests.support.lab import AgentProcess, NamespacedServe
from tests.support.netns import Lab, require_namespace_lab

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(600)]

CP, SERVER, CLIENT, STRANGER = "10.87.0.1", "10.87.0.11", "10.87.0.12", "10.87.0.13"

LISTEN = """
import socket, sys, threading
def handle(c):
    data = c.recv(64)
    if data: c.sendall(data)
    c.close()
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        threading.Thread(target=handle, args=(s.accept()[0],), daemon=True).start()
for port in map(int, sys.argv[1:]):
    threading.Thread(target=serve, args=(port,), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""

PROBE = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
    c.sendall(b"x"); print("open" if c.recv(8) == b"x" else "silent")
except socket.timeout:
    print("timeout")
except OSError:
    print("refused")
"""


def probe(lab: Lab, ns: str, host: str, port: int) -> str:
    done = lab.python(ns, PROBE, host, str(port))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def lab():
    require_namespace_lab()
    hosts = {
        "cp": (CP, None),
        "server": (SERVER, None),
        "client": (CLIENT, None),
        "stranger": (STRANGER, None),
    }
    with Lab.create(hosts) as lab:
        listeners = [
            lab.popen_python("server", LISTEN, "8080"),
            lab.popen_python("client", LISTEN, "9090"),
            lab.popen_python("stranger", LISTEN, "9090"),
        ]
        try:
            for listener in listeners:
                assert listener.stdout.readline().strip() == "ready"
            yield lab
        finally:
            for listener in listeners:
                listener.kill()
                listener.wait(10)


def _marks(lab: Lab, ns: str, destination: str, port: int) -> list:
    done = lab.run(ns, ["conntrack", "-L", "-p", "tcp", "--dst", destination, "--dport", str(port)])
    return [decode_any_mark(int(m)) for m in re.findall(r"\bmark=(\d+)", done.stdout)]


def _outbound(api, workload_id: str, mode: str) -> None:
    before = api.workload(workload_id)["latest_version"]
    change = api.post(
        "/mode-changes", {"selection": {"workload_ids": [workload_id]}, "mode": mode, "direction": "outbound"}
    )
    assert change.status_code == 202, change.text
    assert change.json()["direction"] == "outbound"
    workload = api.workload(workload_id)
    assert workload["outbound_mode"] == mode and workload["latest_version"] != before
    api.wait_converged(workload_id)


def test_outbound_enforced_admits_its_rules_and_the_destinations_inbound_rules_and_never_the_rest(
    lab, tmp_path
):
    serve = NamespacedServe(
        lab, "cp", tmp_path / "cp", operator_listen=f"{CP}:8080", gateway_listen=f"{CP}:8443", migrated=True
    )
    serve.start()
    server = AgentProcess(lab, "server", tmp_path / "server")
    client = AgentProcess(lab, "client", tmp_path / "client")
    try:
        api = serve.api(serve.mint_operator_token("outbound"))
        bundle = api.post("/provisioning-tokens", {"description": "out", "max_uses": 2}).json()["bundle"]
        server_id = server.enrol(bundle, SERVER)
        client_id = client.enrol(bundle, CLIENT)
        for workload_id, role in ((server_id, "server"), (client_id, "client")):
            labelled = api.request("PUT", f"/workloads/{workload_id}/labels", json={"labels": {"role": role}},
                                   headers={"If-Match": '"1"'})  # fmt: skip
            assert labelled.status_code == 200, labelled.text
        inbound = api.post("/rulesets", {"name": "web", "scope": "role=server", "rules": [
            {"sources": [{"selector": "role=client"}], "services": [{"protocol": "tcp", "port": 8080}]}]})  # fmt: skip
        assert inbound.status_code == 201, inbound.text
        assert api.post("/address-groups", {"name": "stranger", "members": [STRANGER]}).status_code == 201
        egress = api.post("/rulesets", {"name": "egress", "scope": "role=server", "direction": "outbound", "rules": [
            {"destinations": [{"address_group": "stranger"}], "services": [{"protocol": "tcp", "port": 9090}]}]})  # fmt: skip
        assert egress.status_code == 201, egress.text
        assert egress.json()["direction"] == "outbound" and "destinations" in egress.json()["rules"][0]
        server.start()
        client.start()
        api.wait_converged(server_id)
        api.wait_converged(client_id)
        # Visibility both ways: nothing is judged on the way out.
        assert probe(lab, "server", CLIENT, 9090) == "open"

        # The server: its outbound rule, and nothing else.
        _outbound(api, server_id, "enforced")
        assert probe(lab, "server", STRANGER, 9090) == "open"
        assert probe(lab, "server", CLIENT, 9090) == "timeout"  # dropped on the way out
        admitted = _marks(lab, "server", STRANGER, 9090)
        assert admitted and all(
            m is not None and (m.direction, m.decision, m.rule) == ("outbound", "allowed", egress.json()["rules"][0]["number"])
            for m in admitted
        ), admitted  # fmt: skip
        # Its agent starts again under that table: a new connection to its gateway, admitted before any rule.
        server.kill()
        server.start()
        api.wait_for(
            "the restarted agent synced", lambda: api.workload(server_id)["sync"]["state"] == "synced"
        )
        # ... and receives a later change.
        before = api.workload(server_id)["applied_version"]
        more = api.post(f"/rulesets/{egress.json()['id']}/rules", {
            "destinations": [{"address_group": "stranger"}], "services": [{"protocol": "tcp", "port": 9091}]})  # fmt: skip
        assert more.status_code == 201, more.text
        api.wait_for("the change applied", lambda: api.workload(server_id)["applied_version"] != before)
        api.wait_converged(server_id)
        assert probe(lab, "server", CLIENT, 9090) == "timeout"

        # The client: no outbound rule at all; the server's inbound rule admits its connection.
        _outbound(api, client_id, "enforced")
        assert probe(lab, "client", SERVER, 8080) == "open"
        both_ends = _marks(lab, "client", SERVER, 8080)
        rule = inbound.json()["rules"][0]["number"]
        assert both_ends and all(
            m is not None and (m.direction, m.decision, m.rule) == ("outbound", "allowed", rule)
            for m in both_ends
        ), both_ends
        assert probe(lab, "client", STRANGER, 9090) == "timeout"

        # Simulation: admitted, marked would_block.
        _outbound(api, client_id, "simulation")
        assert probe(lab, "client", STRANGER, 9090) == "open"
        simulated = _marks(lab, "client", STRANGER, 9090)
        assert simulated and all(
            m is not None and (m.direction, m.decision, m.rule) == ("outbound", "would_block", None)
            for m in simulated
        ), simulated
        assert api.get("/workloads", params={"outbound_mode": "simulation"})["items"][0]["id"] == client_id
    finally:
        server.kill()
        client.kill()
        assert serve.stop() == 0
    assert "Traceback" not in server.log() + client.log(), server.log() + client.log()

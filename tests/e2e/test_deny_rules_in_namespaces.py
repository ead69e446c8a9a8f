"""Deny rules with a real agent, the real serve and traffic (root only): a deny rule in one ruleset refuses
one client what another ruleset's allow admits; the kernel blocks it and the flows name the deny rule;
simulation records it as would-block by the same rule; a connection the client held open from before
the deny rule was saved ends once the agent applies it."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from tests.support.lab import AgentProcess, NamespacedServe
from tests.support.netns import Lab, require_namespace_lab

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(600)]

CP, WEB, GOOD, BAD = "10.89.0.1", "10.89.0.11", "10.89.0.12", "10.89.0.13"

# Echo servers on 8080 and 7070.
SERVER = """
import socket, threading
def handle(c):
    while True:
        data = c.recv(65536)
        if not data: break
        c.sendall(data)
    c.close()
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        threading.Thread(target=handle, args=(s.accept()[0],), daemon=True).start()
for port in (8080, 7070):
    threading.Thread(target=serve, args=(port,), daemon=True).start()
print("ready", flush=True)
import sys; sys.stdin.read()
"""

# Connects, checks the echo, then per line of stdin (a timeout) sends and says what came back:
# "echoed", "reset" (the server's end reset it, or closed it) or "silent" (nothing within the timeout).
HELD = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
c.sendall(b"hello"); assert c.recv(64) == b"hello"
print("connected", flush=True)
for line in sys.stdin:
    c.settimeout(float(line))
    try:
        c.sendall(b"again")
        data = c.recv(64)
        print("echoed" if data == b"again" else "reset" if not data else "other", flush=True)
    except socket.timeout:
        print("silent", flush=True)
    except OSError:
        print("reset", flush=True)
"""

# One connection with an echo: "open" or "refused"/"timeout".
PROBE = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    c.sendall(b"x"); print("open" if c.recv(8) == b"x" else "silent")
except socket.timeout:
    print("timeout")
except OSError:
    print("refused")
"""


def probe(lab: Lab, ns: str, port: int, timeout: float = 1.5) -> str:
    done = lab.python(ns, PROBE, WEB, str(port), str(timeout))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def lab():
    require_namespace_lab()
    with Lab.create({"cp": (CP, None), "web": (WEB, None), "good": (GOOD, None), "bad": (BAD, None)}) as lab:
        server = lab.popen_python("web", SERVER)
        assert server.stdout.readline().strip() == "ready"
        yield lab
        server.kill()
        server.wait(10)


def _instant(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def _decisions(api, workload_id: str, since: datetime) -> set[tuple]:
    page = api.get("/flows", params={"workload": workload_id, "from": _instant(since),
                                     "to": _instant(datetime.now(UTC) + timedelta(seconds=5)), "limit": 500})  # fmt: skip
    return {
        (g["peer"], g["port"], g["decision"], g["rule_id"])
        for window in page["items"]
        for g in window["groups"]
        if g["port"] in (7070, 8080) and g["connection_count"]
    }


def _held_entries(lab: Lab) -> list[str]:
    """The web host's conntrack entries of the bad client's connections to 8080."""
    done = lab.run("web", ["conntrack", "-L", "-p", "tcp", "--src", BAD, "--dport", "8080"])
    return [line for line in done.stdout.splitlines() if "ESTABLISHED" in line]


def test_a_deny_rule_refuses_above_allows_names_itself_and_ends_open_connections(lab, tmp_path):
    serve = NamespacedServe(
        lab, "cp", tmp_path / "cp", operator_listen=f"{CP}:8080", gateway_listen=f"{CP}:8443", migrated=True
    )
    serve.start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    held = None
    try:
        api = serve.api(serve.mint_operator_token("deny"))
        bundle = api.post("/provisioning-tokens", {"description": "deny", "max_uses": 3}).json()["bundle"]
        web_id = web.enrol(bundle, WEB)
        # The clients are workloads of the fleet (enrolled, no agent running): a selector picks them.
        for ns, address in (("good", GOOD), ("bad", BAD)):
            client_id = AgentProcess(lab, ns, tmp_path / ns).enrol(bundle, address)
            api.request("PUT", f"/workloads/{client_id}/labels", json={"labels": {"role": "client"}},
                        headers={"If-Match": '"1"'})  # fmt: skip
        api.request(
            "PUT", f"/workloads/{web_id}/labels", json={"labels": {"app": "web"}}, headers={"If-Match": '"1"'}
        )
        assert api.post("/address-groups", {"name": "partners", "members": [GOOD]}).status_code == 201
        assert api.post("/address-groups", {"name": "banned", "members": [BAD]}).status_code == 201
        allows = api.post("/rulesets", {"name": "web", "scope": "app=web", "rules": [
            {"sources": [{"selector": "role=client"}], "services": [{"protocol": "tcp", "port": 8080}]},
            {"sources": [{"address_group": "partners"}], "services": [{"protocol": "tcp", "port": 7070}]}]})  # fmt: skip
        assert allows.status_code == 201, allows.text
        clients_rule, partners_rule = allows.json()["rules"]
        change = api.post("/mode-changes", {"selection": {"workload_ids": [web_id]}, "mode": "enforced"})
        assert change.status_code == 202, change.text
        web.start("--flow-window-seconds", "2", "--metrics-textfile", str(tmp_path / "agent.prom"),
                  "--metrics-interval-seconds", "1")  # fmt: skip
        api.wait_converged(web_id)
        began = datetime.now(UTC) - timedelta(seconds=3)

        # Before the deny rule: the bad client is a client like the other, and holds a connection open.
        assert probe(lab, "bad", 8080) == "open"
        held = lab.popen_python("bad", HELD, WEB, "8080")
        assert held.stdout.readline().strip() == "connected"
        held.stdin.write("3\n")
        held.stdin.flush()
        assert held.stdout.readline().strip() == "echoed"
        assert _held_entries(lab)

        # A deny rule in another ruleset (named to sort after the allows: order among rulesets does
        # not matter to a deny).
        before = api.workload(web_id)["applied_version"]
        blocklist = api.post("/rulesets", {"name": "zz-blocklist", "scope": "app=web", "rules": [
            {"action": "deny", "sources": [{"address_group": "banned"}],
             "services": [{"protocol": "tcp", "port": 8080}]}]})  # fmt: skip
        assert blocklist.status_code == 201, blocklist.text
        deny_rule = blocklist.json()["rules"][0]
        assert deny_rule["action"] == "deny"
        api.wait_for("the deny rule applied", lambda: api.workload(web_id)["applied_version"] != before)
        api.wait_converged(web_id)

        # The held connection ends within seconds of the apply: its entry is gone (the next segment
        # would meet the deny rule) and the workload's socket of it aborted, so the client is reset.
        api.wait_for("the held connection's entry removed", lambda: not _held_entries(lab), timeout=10)
        held.stdin.write("2\n")
        held.stdin.flush()
        assert held.stdout.readline().strip() == "reset"
        assert "ended denied connections" in web.log(), web.log()
        metric = tmp_path / "agent.prom"
        api.wait_for(
            f"the metric in {metric.read_text() if metric.exists() else 'no file'}",
            # the held connection, and the probe's entry if it still lingers (TIME_WAIT)
            lambda: re.search(r"^palisade_agent_denied_connections_ended_total [12]\.0$", metric.read_text(), re.MULTILINE),
            timeout=10,
        )  # fmt: skip

        # New connections: the deny rule beats the allow for the bad client only.
        assert probe(lab, "bad", 8080) == "timeout"
        assert probe(lab, "good", 8080) == "open"
        assert probe(lab, "good", 7070) == "open"
        assert probe(lab, "bad", 7070) == "timeout"  # no rule admits it: the terminal rule

        want = {
            (BAD, 8080, "blocked", deny_rule["id"]),
            (GOOD, 8080, "allowed", clients_rule["id"]),
            (GOOD, 7070, "allowed", partners_rule["id"]),
            (BAD, 7070, "blocked", None),
        }
        try:
            api.wait_for("the enforced flows", lambda: want <= _decisions(api, web_id, began), timeout=30)
        except AssertionError as error:
            raise AssertionError(f"{error}: {_decisions(api, web_id, began)}") from None
        assert (BAD, 8080, "allowed", deny_rule["id"]) not in _decisions(api, web_id, began)

        # Simulation: the same traffic passes, recorded would-block by the deny rule.
        api.post("/mode-changes", {"selection": {"workload_ids": [web_id]}, "mode": "simulation"})
        api.wait_for("simulation", lambda: api.workload(web_id)["mode"] == "simulation")
        api.wait_converged(web_id)
        simulated = datetime.now(UTC) - timedelta(seconds=1)
        assert probe(lab, "bad", 8080) == "open"
        assert probe(lab, "good", 8080) == "open"
        want = {(BAD, 8080, "would_block", deny_rule["id"]), (GOOD, 8080, "allowed", clients_rule["id"])}
        try:
            api.wait_for(
                "the simulated flows", lambda: want <= _decisions(api, web_id, simulated), timeout=30
            )
        except AssertionError as error:
            raise AssertionError(f"{error}: {_decisions(api, web_id, simulated)}") from None
    finally:
        if held is not None:
            held.kill()
            held.wait(10)
        web.kill()
        assert serve.stop() == 0
    assert "Traceback" not in web.log(), web.log()

"""Rule attribution across policy versions and bytes with accounting on and off, from a real agent in a
namespace through the real serve: a connection opened under one policy version and closed under the
next still names the rule that admitted it, and its bytes land only when the host counts them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tests.support.lab import AgentProcess, NamespacedServe
from tests.support.netns import Lab, require_namespace_lab

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(600)]

CP, WEB, CLIENT = "10.88.0.1", "10.88.0.11", "10.88.0.12"
SENT, ANSWERED = 1000, 3000

# Reads SENT bytes, answers ANSWERED bytes, then waits for the client to close.
SERVER = f"""
import socket, sys, threading
def handle(c):
    got = 0
    while got < {SENT}:
        chunk = c.recv(65536)
        if not chunk: break
        got += len(chunk)
    c.sendall(b"y" * {ANSWERED})
    while c.recv(65536): pass
    c.close()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7070)); s.listen(16)
print("ready", flush=True)
while True:
    threading.Thread(target=handle, args=(s.accept()[0],), daemon=True).start()
"""

# Connects and sends SENT bytes; on a line from stdin reads the answer and closes.
CLIENT_CODE = f"""
import socket, sys
c = socket.create_connection((sys.argv[1], 7070), timeout=10)
c.sendall(b"x" * {SENT})
print("connected", flush=True)
sys.stdin.readline()
got = 0
while got < {ANSWERED}:
    chunk = c.recv(65536)
    if not chunk: break
    got += len(chunk)
c.close()
print("done", got, flush=True)
"""


@pytest.fixture
def lab():
    require_namespace_lab()
    with Lab.create({"cp": (CP, None), "web": (WEB, None), "client": (CLIENT, None)}) as lab:
        # A closed TCP connection's entry (and the DESTROY event that carries its bytes) would otherwise
        # wait out TIME_WAIT, two minutes.
        for state in ("time_wait", "fin_wait", "close", "close_wait", "last_ack"):
            lab.run("web", ["sysctl", "-qw", f"net.netfilter.nf_conntrack_tcp_timeout_{state}=1"])
        server = lab.popen_python("web", SERVER)
        assert server.stdout.readline().strip() == "ready"
        yield lab
        server.kill()
        server.wait(10)


def _instant(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def _groups(api, workload_id: str, since: datetime) -> list[dict]:
    page = api.get(
        "/flows",
        params={"workload": workload_id, "from": _instant(since), "to": _instant(datetime.now(UTC) + timedelta(seconds=5)),
                "limit": 500},
    )  # fmt: skip
    return [
        {**group, "accounting": window["accounting"]}
        for window in page["items"]
        for group in window["groups"]
    ]


def _connection(lab) -> object:
    client = lab.popen_python("client", CLIENT_CODE, WEB)
    assert client.stdout.readline().strip() == "connected"
    return client


def _close(client) -> None:
    client.stdin.write("\n")
    client.stdin.flush()
    assert client.stdout.readline().startswith("done"), "the client did not finish"
    client.wait(10)


def _acct(lab, on: bool) -> None:
    done = lab.run("web", ["sysctl", "-qw", f"net.netfilter.nf_conntrack_acct={1 if on else 0}"])
    assert done.returncode == 0, done.stderr


def test_a_connection_keeps_its_rule_across_a_policy_change_and_bytes_follow_accounting(lab, tmp_path):
    serve = NamespacedServe(
        lab, "cp", tmp_path / "cp", operator_listen=f"{CP}:8080", gateway_listen=f"{CP}:8443", migrated=True
    )
    serve.start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    try:
        api = serve.api(serve.mint_operator_token("attribution"))
        bundle = api.post("/provisioning-tokens", {"description": "attr", "max_uses": 1}).json()["bundle"]
        web_id = web.enrol(bundle, WEB)
        api.request(
            "PUT", f"/workloads/{web_id}/labels", json={"labels": {"app": "web"}}, headers={"If-Match": '"1"'}
        )
        created = api.post("/rulesets", {"name": "web", "scope": "app=web", "rules": [
            {"description": "the app", "sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 7070}]}]})  # fmt: skip
        assert created.status_code == 201, created.text
        ruleset, rule = created.json(), created.json()["rules"][0]
        assert (
            api.post(
                "/mode-changes", {"selection": {"workload_ids": [web_id]}, "mode": "simulation"}
            ).status_code
            == 202
        )
        _acct(lab, on=True)
        web.start("--flow-window-seconds", "2")
        first = api.wait_converged(web_id)["applied_version"]
        began = datetime.now(UTC) - timedelta(seconds=3)

        # Opened under the first version.
        long_lived = _connection(lab)
        # A new version in which the rule sits behind another ruleset's rule (a position number would
        # now name that other rule) and admits one more port.
        other = api.post("/rulesets", {"name": "aaa-first", "scope": "", "rules": [
            {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 7072}]}]})  # fmt: skip
        assert other.status_code == 201, other.text
        changed = api.request(
            "PUT", f"/rulesets/{ruleset['id']}/rules/{rule['id']}",
            json={"description": "the app", "sources": [{"any": True}],
                  "services": [{"protocol": "tcp", "port": 7070}, {"protocol": "tcp", "port": 7071}]},
            headers={"If-Match": f'"{rule["version"]}"'},
        )  # fmt: skip
        assert changed.status_code == 200, changed.text
        # Against the version applied before either change: read after them, the agent may already have
        # applied the last one, and nothing would change again.
        api.wait_for("the new version applied", lambda: api.workload(web_id)["applied_version"] != first)
        api.wait_converged(web_id)
        _close(long_lived)  # closed under the new version: its bytes arrive with DESTROY
        _close(_connection(lab))  # opened and closed under the new version

        def attributed():
            # Expired entries wait for conntrack's garbage collector, which may take a minute under
            # load; a dump of the table reaps them at once (and sends their DESTROY events).
            lab.run("web", ["conntrack", "-L"])
            groups = [g for g in _groups(api, web_id, began) if g["port"] == 7070]
            return groups if sum(g["connection_count"] for g in groups) == 2 and sum(g["bytes_in"] for g in groups) >= 2 * SENT and sum(g["bytes_out"] for g in groups) >= 2 * ANSWERED else None  # fmt: skip

        try:
            groups = api.wait_for("both connections and their bytes", attributed, timeout=60)
        except AssertionError as error:
            raise AssertionError(f"{error}: the groups at 7070 are {_groups(api, web_id, began)}") from None
        assert {(g["peer"], g["decision"], g["rule_id"]) for g in groups} == {(CLIENT, "allowed", rule["id"])}
        assert all(g["accounting"] for g in groups)
        # IP-level bytes: the payload and the headers of a handful of packets, nothing more.
        assert 2 * SENT <= sum(g["bytes_in"] for g in groups) < 2 * SENT + 2000
        assert 2 * ANSWERED <= sum(g["bytes_out"] for g in groups) < 2 * ANSWERED + 2000

        # Accounting off: the windows say so, and no bytes are claimed.
        web.kill()
        _acct(lab, on=False)
        restarted = datetime.now(UTC)
        web.start("--flow-window-seconds", "2")
        api.wait_converged(web_id)
        _close(_connection(lab))

        def counted_without_bytes():
            groups = [
                g for g in _groups(api, web_id, restarted) if g["port"] == 7070 and g["connection_count"]
            ]
            return groups or None

        groups = api.wait_for("a window without accounting", counted_without_bytes, timeout=60)
        assert all(not g["accounting"] and g["bytes_in"] == g["bytes_out"] == 0 for g in groups)
        assert {g["rule_id"] for g in groups} == {rule["id"]}
    finally:
        web.kill()
        _acct(lab, on=False)
        assert serve.stop() == 0
    assert "Traceback" not in web.log(), web.log()

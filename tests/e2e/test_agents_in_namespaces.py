"""End to end with real traffic: `serve` and two real agents in network namespaces, nftables in the
kernel, the operator API over TLS. One scenario, step by step, as an operator would live it."""

import shutil
import signal
import sqlite3
import subprocess
import time

import pytest

from tests.support.lab import TCP_SERVER, AgentProcess, NamespacedServe, probe, via_unix_socket
from tests.support.netns import Lab, require_namespace_lab
from tests.support.requirements import require
from tests.support.serve_process import throwaway_database

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(900)]

CP, WEB, CLIENT = "10.88.0.1", "10.88.0.11", "10.88.0.12"
REDIS_PORT = 6390
BROKEN_DOCUMENT = (
    "table inet palisade {\n\tchain input {\n\t\ttype filter hook input priority filter; policy accept;\n"
    "\t\tjump no_such_chain\n\t}\n}\n"
)


@pytest.fixture
def lab():
    require_namespace_lab()
    require(shutil.which("redis-server") is not None, "needs redis-server (apt install redis-server)")
    with Lab.create({"cp": (CP, None), "web": (WEB, None), "client": (CLIENT, None)}) as lab:
        yield lab


@pytest.fixture
def redis(lab):
    """A Redis of the control plane's own, on its namespace's loopback, for two serve processes."""
    process = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            lab.ns("cp"),
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            str(REDIS_PORT),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    yield process
    process.kill()
    process.wait(10)


@pytest.fixture
def web_servers(lab):
    """TCP servers on the protected workload: 8080 will be admitted, 9090 not."""
    process = lab.popen_python("web", TCP_SERVER, "8080", "9090")
    assert process.stdout.readline().strip() == "ready"
    yield process
    process.kill()
    process.wait(10)


def inject_broken_latest(data_dir, database_url, workload_id):
    """Point the workload's latest version at a document the kernel refuses (a fault a test injects)."""
    version = "sha256:" + "b" * 32
    rows = (
        "INSERT INTO fleet_renderedpolicy (version, document, rule_index, created_at) VALUES (%s, %s, %s, now())",
        "UPDATE fleet_workload SET latest_policy_id = %s WHERE id = %s",
    )
    if database_url:
        import psycopg

        with psycopg.connect(database_url, autocommit=True) as db:
            db.execute(rows[0], (version, BROKEN_DOCUMENT, "{}"))
            db.execute(rows[1], (version, workload_id))
    else:
        with sqlite3.connect(data_dir / "palisade.sqlite3") as db:
            db.execute(
                rows[0].replace("%s", "?").replace("now()", "datetime('now')"),
                (version, BROKEN_DOCUMENT, "{}"),
            )
            db.execute(rows[1].replace("%s", "?"), (version, workload_id.replace("-", "")))
    return version


def table_listing(lab, ns):
    return lab.run(ns, ["nft", "list", "table", "inet", "palisade"])


def test_enrol_enforce_degrade_remove_restore_kill_restart_and_resend_across_processes(
    lab, redis, web_servers, tmp_path
):
    agents: list[AgentProcess] = []
    with throwaway_database(migrated=True) as tcp_database_url:
        database_url = via_unix_socket(tcp_database_url)
        data_dir = tmp_path / "cp"
        env = {"REDIS_URL": f"redis://127.0.0.1:{REDIS_PORT}/0"}  # the namespace's own loopback

        def serve(operator_port, gateway_port):
            return NamespacedServe(
                lab,
                "cp",
                data_dir,
                database_url=database_url,
                env=env,
                operator_listen=f"{CP}:{operator_port}",
                gateway_listen=f"{CP}:{gateway_port}",
                migrated=True,
            ).start()

        first = serve(8080, 8443)
        try:
            token = first.mint_operator_token("e2e")
            api = first.api(token)

            # -- enrol two agents with one token; each goes pending, then synced --
            minted = api.post("/provisioning-tokens", {"description": "e2e", "max_uses": 2})
            assert minted.status_code == 201, minted.text
            bundle = minted.json()["bundle"]
            web, client = (
                AgentProcess(lab, "web", tmp_path / "web"),
                AgentProcess(lab, "client", tmp_path / "client"),
            )
            agents += [web, client]
            web_id, client_id = web.enrol(bundle, WEB), client.enrol(bundle, CLIENT)
            assert api.workload(web_id)["sync"]["never_connected"] is True
            web.start()
            client.start()
            api.wait_for(
                "web pending or synced",
                lambda: api.workload(web_id)["sync"]["state"] in ("pending", "synced"),
            )
            for workload_id in (web_id, client_id):
                api.wait_converged(workload_id)

            # -- visibility: every connection passes --
            assert probe(lab, "client", WEB, 8080) == "open"
            assert probe(lab, "client", WEB, 9090) == "open"

            # -- a ruleset admits tcp/8080 from role=client to app=web --
            for workload_id, labels in ((web_id, {"app": "web"}), (client_id, {"role": "client"})):
                response = api.request(
                    "PUT",
                    f"/workloads/{workload_id}/labels",
                    json={"labels": labels},
                    headers={"If-Match": '"1"'},
                )
                assert response.status_code == 200, response.text
            ruleset = api.post(
                "/rulesets",
                {
                    "name": "web",
                    "scope": "app=web",
                    "rules": [
                        {
                            "sources": [{"selector": "role=client"}],
                            "services": [{"protocol": "tcp", "port": 8080}],
                        }
                    ],
                },
            )
            assert ruleset.status_code == 201, ruleset.text

            # -- enforced: the admitted connection passes, the other is dropped --
            change = api.post("/mode-changes", {"selection": {"labels": ["app=web"]}, "mode": "enforced"})
            assert change.status_code == 202 and change.json()["changed_count"] == 1
            enforced = api.wait_converged(web_id)
            assert enforced["mode"] == "enforced"
            assert probe(lab, "client", WEB, 8080) == "open"
            assert probe(lab, "client", WEB, 9090) == "closed"

            # -- simulation lets both pass --
            api.post("/mode-changes", {"selection": {"workload_ids": [web_id]}, "mode": "simulation"})
            api.wait_converged(web_id)
            assert probe(lab, "client", WEB, 8080) == "open"
            assert probe(lab, "client", WEB, 9090) == "open"
            api.post("/mode-changes", {"selection": {"workload_ids": [web_id]}, "mode": "enforced"})
            good = api.wait_converged(web_id)

            # -- a document the kernel refuses: degraded with the error, the old table kept --
            inject_broken_latest(data_dir, tcp_database_url, web_id)
            assert api.post(f"/workloads/{web_id}/resend-snapshot").status_code == 200
            degraded = api.wait_for(
                "web degraded", lambda: (w := api.workload(web_id))["sync"]["state"] == "degraded" and w
            )
            assert degraded["sync"]["error"], degraded
            assert degraded["applied_version"] == good["applied_version"]
            assert probe(lab, "client", WEB, 8080) == "open" and probe(lab, "client", WEB, 9090) == "closed"
            api.post("/mode-changes", {"selection": {"workload_ids": [web_id]}, "mode": "simulation"})
            api.post("/mode-changes", {"selection": {"workload_ids": [web_id]}, "mode": "enforced"})
            api.wait_converged(web_id)

            # -- the table deleted on the host: absent, first in fleet order, counted as removed --
            assert lab.run("web", ["nft", "delete", "table", "inet", "palisade"]).returncode == 0
            api.wait_for(
                "web reported absent",
                lambda: api.workload(web_id)["health"]["owned_table"]["state"] == "absent",
            )
            assert api.get("/workloads")["items"][0]["id"] == web_id
            counts = api.get("/workloads/counts")
            assert counts["removed"] == 1 and sum(counts["sync_state"].values()) == 1
            assert [w["id"] for w in api.get("/workloads", params={"removed": "true"})["items"]] == [web_id]
            assert table_listing(lab, "web").returncode != 0  # the agent does not restore it on its own
            assert probe(lab, "client", WEB, 9090) == "open"
            sent_before = api.workload(web_id)["sync"]["last_snapshot_sent_at"]
            assert api.post(f"/workloads/{web_id}/resend-snapshot").status_code == 200
            api.wait_for(
                "table restored", lambda: api.workload(web_id)["health"]["owned_table"]["state"] == "present"
            )
            assert api.workload(web_id)["sync"]["last_snapshot_sent_at"] != sent_before
            assert table_listing(lab, "web").returncode == 0
            assert probe(lab, "client", WEB, 9090) == "closed"

            # -- the agent killed: offline, enforcement unchanged in the kernel --
            web.kill(signal.SIGKILL)
            api.wait_for("web offline", lambda: api.workload(web_id)["sync"]["state"] == "offline")
            assert probe(lab, "client", WEB, 8080) == "open" and probe(lab, "client", WEB, 9090) == "closed"
            refused = api.post(f"/workloads/{web_id}/resend-snapshot")
            assert refused.status_code == 409 and refused.json()["last_heard_from"]
            web = AgentProcess(lab, "web", tmp_path / "web").start()
            agents.append(web)
            api.wait_converged(web_id)

            # -- serve restarted: every agent back to synced without operator action --
            sent = {w: api.workload(w)["sync"]["last_snapshot_sent_at"] for w in (web_id, client_id)}
            assert first.stop() == 0
            first = serve(8080, 8443)
            api = first.api(token)
            for workload_id in (web_id, client_id):
                api.wait_for(
                    "a fresh stream after the restart",
                    lambda: api.workload(workload_id)["sync"]["last_snapshot_sent_at"] != sent[workload_id],
                    timeout=120,
                )
                api.wait_converged(workload_id, timeout=120)

            # -- resend through Redis: the operator asks a second process; the stream is on the first --
            second = serve(9080, 9443)
            try:
                other_api = second.api(token)
                sent_before = api.workload(client_id)["sync"]["last_snapshot_sent_at"]
                assert other_api.post(f"/workloads/{client_id}/resend-snapshot").status_code == 200
                api.wait_for(
                    "client reconnected to the first process",
                    lambda: api.workload(client_id)["sync"]["last_snapshot_sent_at"] != sent_before,
                )
                api.wait_converged(client_id)
            finally:
                second.stop()
        finally:
            for agent in agents:
                agent.kill(signal.SIGTERM)
            first.kill()
            print("\n".join(f"--- {a.ns} agent log\n{a.log()}" for a in agents))
            print("--- serve log\n" + first.stderr_text()[-20000:])

"""Flow evidence end to end: a real agent in a namespace counts real connections through its conntrack
and NFLOG sources, reports its windows to the real serve, and the operator API shows counts equal to
ground truth (admitted, would-block, blocked with retransmits) and the rule that decided."""

from __future__ import annotations

import re
import signal
import time
from contextlib import contextmanager

import pytest

from tests.support.lab import CUTTING_RELAY, TCP_SERVER, AgentProcess, NamespacedServe, probe
from tests.support.netns import Lab, require_namespace_lab

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(600)]

CP, WEB, CLIENT = "10.89.0.1", "10.89.0.11", "10.89.0.12"
ADMITTED, OTHER = 5, 4
RANGE = {"from": "2020-01-01T00:00:00Z", "to": "2020-01-01T00:00:01Z"}


@pytest.fixture
def lab():
    require_namespace_lab()
    with Lab.create({"cp": (CP, None), "web": (WEB, None), "client": (CLIENT, None)}) as lab:
        servers = lab.popen_python("web", TCP_SERVER, "8080", "9090")
        assert servers.stdout.readline().strip() == "ready"
        yield lab
        servers.kill()
        servers.wait(10)


def _totals(api, workload_id: str, start: str, end: str) -> dict:
    totals: dict = {}
    page = api.get("/flows", params={"workload": workload_id, "from": start, "to": end, "limit": 500})
    for window in page["items"]:
        for group in window["groups"]:
            key = (group["peer"], group["port"], group["decision"], group["rule_id"])
            totals[key] = totals.get(key, 0) + group["connection_count"]
    return totals


def _serve(lab, tmp_path) -> NamespacedServe:
    """serve in the control plane's namespace, on its data directory (the same one when started again)."""
    return NamespacedServe(
        lab, "cp", tmp_path / "cp", operator_listen=f"{CP}:8080", gateway_listen=f"{CP}:8443", migrated=True
    )


def _enrolled(serve, web: AgentProcess):
    api = serve.api(serve.mint_operator_token("flows"))
    bundle = api.post("/provisioning-tokens", {"description": "flows", "max_uses": 1}).json()["bundle"]
    return api, web.enrol(bundle, WEB)


def test_windows_from_a_real_agent_reach_the_operator_api_with_exact_counts(lab, tmp_path):
    from datetime import UTC, datetime, timedelta

    serve = _serve(lab, tmp_path).start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    try:
        api, web_id = _enrolled(serve, web)
        api.request(
            "PUT", f"/workloads/{web_id}/labels", json={"labels": {"app": "web"}}, headers={"If-Match": '"1"'}
        )
        created = api.post(
            "/rulesets",
            {
                "name": "web",
                "scope": "app=web",
                "rules": [{"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 8080}]}],
            },
        )
        assert created.status_code == 201, created.text
        rule = created.json()["rules"][0]
        web.start("--flow-window-seconds", "2")
        api.wait_converged(web_id)
        began = datetime.now(UTC) - timedelta(seconds=5)

        # Simulation: 8080 admitted by the rule, 9090 would be blocked.
        assert (
            api.post(
                "/mode-changes", {"selection": {"workload_ids": [web_id]}, "mode": "simulation"}
            ).status_code
            == 202
        )
        api.wait_converged(web_id)
        for _ in range(ADMITTED):
            assert probe(lab, "client", WEB, 8080) == "open"
        for _ in range(OTHER):
            assert probe(lab, "client", WEB, 9090) == "open"
        # Enforced: 9090 is dropped; each probe retransmits its SYN within its 1.5 s timeout.
        assert (
            api.post(
                "/mode-changes", {"selection": {"workload_ids": [web_id]}, "mode": "enforced"}
            ).status_code
            == 202
        )
        api.wait_converged(web_id)
        for _ in range(OTHER):
            assert probe(lab, "client", WEB, 9090) == "closed"

        expected = {
            (CLIENT, 8080, "allowed", rule["id"]): ADMITTED,
            (CLIENT, 9090, "would_block", None): OTHER,
            (CLIENT, 9090, "blocked", None): OTHER,
        }

        seen: list[dict] = []

        def counted():
            end = (datetime.now(UTC) + timedelta(seconds=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
            seen[:] = [_totals(api, web_id, began.strftime("%Y-%m-%dT%H:%M:%SZ"), end)]
            return seen[0] == expected and seen[0]

        try:
            api.wait_for(f"the windows to add up to {expected}", counted, timeout=60)
        except AssertionError as timed_out:
            raise AssertionError(
                f"{timed_out}; the windows added up to {seen}; agent log: {web.log()[-3000:]}"
            ) from None
        gaps = api.get("/flows/gaps", params={"workload": web_id, "from": began.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                               "to": (datetime.now(UTC) + timedelta(seconds=5)).strftime("%Y-%m-%dT%H:%M:%SZ")})  # fmt: skip
        assert gaps["items"] == []
        assert api.workload(web_id)["health"]["telemetry_live"] is True

        status = web.cli("status", "--state-dir", str(tmp_path / "web"))
        assert (
            "flows:        conntrack subscribed" in status.stdout and "nflog subscribed" in status.stdout
        ), status.stdout

        # Enforcement removed on the host: every window period while it lasts is a table_removed gap.
        removed_at = datetime.now(UTC) - timedelta(seconds=1)
        assert lab.run("web", ["nft", "delete", "table", "inet", "palisade"]).returncode == 0

        def table_removed_gaps():
            end = (datetime.now(UTC) + timedelta(seconds=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
            page = api.get(
                "/flows/gaps",
                params={"workload": web_id, "from": removed_at.strftime("%Y-%m-%dT%H:%M:%SZ"), "to": end},
            )
            return [(g["kind"], g["source"]) for g in page["items"]]

        found = api.wait_for(
            "table_removed gaps", lambda: len(table_removed_gaps()) >= 2 and table_removed_gaps(), timeout=30
        )
        assert set(found) == {("table_removed", None)}
    finally:
        web.kill()
        assert serve.stop() == 0
    assert "Traceback" not in web.log(), web.log()


def test_a_quick_restart_records_no_gap_and_an_outage_longer_than_the_buffer_records_buffer_overflow(
    lab, tmp_path
):
    from datetime import UTC, datetime, timedelta

    def text(at):
        return at.strftime("%Y-%m-%dT%H:%M:%SZ")

    serve = _serve(lab, tmp_path).start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    flags = ("--flow-window-seconds", "3", "--flow-buffer-records", "2")
    try:
        api, web_id = _enrolled(serve, web)
        web.start(*flags)
        api.wait_converged(web_id)
        began = datetime.now(UTC) - timedelta(seconds=2)
        assert probe(lab, "client", WEB, 8080) == "open"
        api.wait_for("a first report", lambda: api.workload(web_id)["health"]["telemetry_live"], timeout=30)

        # A quick restart: the open window is kept, the new process reports, nothing is silent.
        web.kill(signal.SIGTERM)
        web.start(*flags)
        assert probe(lab, "client", WEB, 8080) == "open"
        api.wait_converged(web_id)

        def windows_total():
            page = api.get(
                "/flows",
                params={
                    "workload": web_id,
                    "from": text(began),
                    "to": text(datetime.now(UTC) + timedelta(seconds=9)),
                },
            )
            return sum(g["connection_count"] for w in page["items"] for g in w["groups"])

        # The first connection is still in the table (TIME_WAIT) when the new process subscribes: found
        # live then, it counts again, as the spec defines a subscription's count.
        api.wait_for("both connections reported", lambda: windows_total() >= 2, timeout=30)
        gaps = api.get(
            "/flows/gaps",
            params={
                "workload": web_id,
                "from": text(began),
                "to": text(datetime.now(UTC) + timedelta(seconds=9)),
            },
        )
        assert gaps["items"] == []

        # The control plane away for more windows than the buffer holds: the oldest are dropped, and
        # buffer_overflow gaps say which.
        assert serve.stop() == 0
        for _ in range(4):
            assert probe(lab, "client", WEB, 8080) == "open"
            time.sleep(3)
        serve = _serve(lab, tmp_path).start()
        api = serve.api(serve.mint_operator_token("flows-again"))

        def overflow():
            page = api.get(
                "/flows/gaps",
                params={
                    "workload": web_id,
                    "from": text(began),
                    "to": text(datetime.now(UTC) + timedelta(seconds=9)),
                },
            )
            return [g for g in page["items"] if g["kind"] == "buffer_overflow"]

        found = api.wait_for("buffer_overflow gaps", overflow, timeout=60)
        assert all(g["source"] is None and g["lost"]["windows"] >= 1 for g in found)
    finally:
        web.kill()
        serve.stop()
    assert "Traceback" not in web.log(), web.log()


def test_more_keys_than_a_window_counts_one_by_one_are_summed_into_its_aggregate_key_and_said_so(
    lab, tmp_path
):
    from datetime import UTC, datetime, timedelta

    serve = _serve(lab, tmp_path).start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    try:
        api, web_id = _enrolled(serve, web)
        web.start("--flow-window-seconds", "5", "--flow-window-keys", "1")
        api.wait_converged(web_id)
        began = datetime.now(UTC) - timedelta(seconds=5)
        # Two keys (one per service) in one window that counts one: the second's two connections go
        # to the aggregate key, and the window says so. Start just after a window boundary, so that
        # the three probes fall in one window.
        time.sleep(5 - time.time() % 5 + 0.2)
        assert probe(lab, "client", WEB, 8080) == "open"
        assert probe(lab, "client", WEB, 9090) == "open"
        assert probe(lab, "client", WEB, 9090) == "open"

        def span() -> dict:
            end = (datetime.now(UTC) + timedelta(seconds=10)).strftime("%Y-%m-%dT%H:%M:%SZ")
            return {"workload": web_id, "from": began.strftime("%Y-%m-%dT%H:%M:%SZ"), "to": end}

        def aggregated():
            return [
                g for g in api.get("/flows/gaps", params=span())["items"] if g["kind"] == "keys_aggregated"
            ]

        gaps = api.wait_for("a keys_aggregated gap", aggregated, timeout=40)
        assert [(g["source"], g["lost"]) for g in gaps] == [(None, {"keys": 1, "connections": 2})], gaps
        windows = api.wait_for(
            "the window's aggregate key", lambda: api.get("/flows", params={**span(), "peer": "*"})["items"]
        )
        ((summed,),) = [w["groups"] for w in windows]
        assert (summed["peer"], summed["protocol"], summed["port"], summed["connection_count"]) == (
            "*",
            "*",
            0,
            2,
        )
        assert _totals(api, web_id, span()["from"], span()["to"]) == {
            (CLIENT, 8080, "observed", None): 1,
            ("*", 0, "observed", None): 2,
        }
    finally:
        web.kill()
        serve.stop()


def test_a_window_the_control_plane_refuses_is_a_window_rejected_gap_of_its_range(lab, tmp_path):
    """A window the agent holds from before a restart with another window length is refused (a window
    is as long as its report says), and the agent records a window_rejected gap of exactly its range."""
    from datetime import UTC, datetime, timedelta

    serve = _serve(lab, tmp_path).start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    try:
        api, web_id = _enrolled(serve, web)
        web.start("--flow-window-seconds", "5")
        api.wait_converged(web_id)
        serve.stop()  # the control plane away: the next window waits in the agent's buffer
        began = datetime.now(UTC) - timedelta(seconds=5)
        time.sleep(5 - time.time() % 5 + 0.2)
        probed = datetime.now(UTC)
        assert probe(lab, "client", WEB, 8080) == "open"  # the table stays as it was: fail static
        time.sleep(6)  # that window closed, into the buffer
        web.kill(signal.SIGTERM)
        serve = _serve(lab, tmp_path).start()
        web.start("--flow-window-seconds", "2")

        def evidence():
            span = {"workload": web_id, "from": began.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "to": (datetime.now(UTC) + timedelta(seconds=10)).strftime("%Y-%m-%dT%H:%M:%SZ")}  # fmt: skip
            return api.get("/flows/gaps", params=span)["items"], api.get("/flows", params=span)["items"]

        api = serve.api(serve.mint_operator_token("flows-again"))

        def rejected():
            return [g for g in evidence()[0] if g["kind"] == "window_rejected"]

        # (The restart with nothing stored since the control plane went away is also agent_silent.)
        gaps = api.wait_for("a window_rejected gap", rejected, timeout=40)
        # One gap per refused window (the probe's, and any other the old process held), each exactly
        # the window's range, and none of them stored.
        assert {(g["source"], str(g["lost"])) for g in gaps} == {(None, str({"windows": 1}))}
        ranges = [(datetime.fromisoformat(g["start"]), datetime.fromisoformat(g["end"])) for g in gaps]
        assert all(end - start == timedelta(seconds=5) for start, end in ranges)
        assert any(start <= probed < end for start, end in ranges), (probed, ranges)
        stored = {w["start"] for w in evidence()[1]}
        assert not stored & {g["start"] for g in gaps}  # the refused windows are not stored
    finally:
        web.kill()
        serve.stop()
    assert "flow window refused" in web.log()


# Another NFLOG listener (ulogd, say) holding the group the renderer logs drops to: the kernel admits one.
NFLOG_SQUATTER = """
import sys
from agent.nflog import nflog_socket
sock = nflog_socket(1 << 20)
print("bound", flush=True)
sys.stdin.readline()
"""


def test_a_source_that_cannot_subscribe_is_a_source_restart_gap_until_it_does(lab, tmp_path):
    from datetime import UTC, datetime, timedelta

    serve = _serve(lab, tmp_path).start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    squatter = lab.popen_python("web", NFLOG_SQUATTER)
    try:
        assert squatter.stdout.readline().strip() == "bound"
        api, web_id = _enrolled(serve, web)
        started = datetime.now(UTC)
        web.start("--flow-window-seconds", "2")
        api.wait_converged(web_id)
        api.wait_for("the nflog source to fail", lambda: "flow source failed" in web.log(), timeout=20)
        time.sleep(2)
        released = datetime.now(UTC)
        squatter.stdin.write("\n")
        squatter.stdin.flush()
        squatter.wait(10)

        def gaps():
            span = {"workload": web_id, "from": (started - timedelta(seconds=5)).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "to": (datetime.now(UTC) + timedelta(seconds=10)).strftime("%Y-%m-%dT%H:%M:%SZ")}  # fmt: skip
            return api.get("/flows/gaps", params=span)["items"]

        found = api.wait_for("a source_restart gap", gaps, timeout=40)
        assert [(g["kind"], g["source"]) for g in found] == [("source_restart", "nflog")], found
        (gap,) = found
        down_from, down_to = datetime.fromisoformat(gap["start"]), datetime.fromisoformat(gap["end"])
        assert started <= down_from < released, (started, gap)  # from its first failed subscribe
        assert released <= down_to < released + timedelta(seconds=5), (released, gap)  # until it subscribed
        status = web.cli("status", "--state-dir", str(tmp_path / "web"))
        assert "nflog subscribed" in status.stdout, status.stdout + web.log()[-3000:]
    finally:
        squatter.kill()
        web.kill()
        serve.stop()


# Sends one datagram from each of COUNT fixed source ports to HOST:PORT: COUNT new conntrack entries
# (each its own 5-tuple; UDP entries stay in the table for 30 s, unreplied).
UDP_BURST = """
import socket, sys
host, port, count, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for source_port in range(first, first + count):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", source_port))
    s.sendto(b"x", (host, port))
    s.close()
"""


def _span(began, extra_seconds: int = 10) -> dict:
    from datetime import UTC, datetime, timedelta

    return {
        "from": began.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "to": (datetime.now(UTC) + timedelta(seconds=extra_seconds)).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _udp_count(api, web_id: str, began, port: int, protocol: str = "udp") -> int:
    page = api.get(
        "/flows/rollup", params={"workload": web_id, "group_by": ["peer", "service"], **_span(began)}
    )
    return sum(
        item["connection_count"]
        for item in page["items"]
        if item["peer"] == CLIENT and item["service"] == {"protocol": protocol, "port": port}
    )


def _tcp_count(api, web_id: str, began, port: int) -> int:
    return _udp_count(api, web_id, began, port, protocol="tcp")


def test_a_burst_over_a_tiny_netlink_buffer_is_a_source_overrun_and_the_counts_stay_exact(lab, tmp_path):
    """ENOBUFS on the conntrack socket: the agent says evidence was lost (source_overrun, conntrack),
    dumps the table again and counts every connection still in it once, so the totals through the
    operator API equal the connections the kernel made. (Dumping before the socket's queue was read
    empty counted 1,659 of 3,000 here: the kernel drops silently until then.)"""
    from datetime import UTC, datetime, timedelta

    serve = _serve(lab, tmp_path).start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    burst = 3000
    try:
        api, web_id = _enrolled(serve, web)
        web.start("--flow-window-seconds", "2", "--flow-netlink-buffer", "4096")
        api.wait_converged(web_id)
        began = datetime.now(UTC) - timedelta(seconds=2)
        sent = lab.python("client", UDP_BURST, WEB, "7777", str(burst), "20000")
        assert sent.returncode == 0, sent.stderr

        counts: list[int] = []
        api.wait_for(
            f"{burst} connections counted",
            lambda: counts.append(_udp_count(api, web_id, began, 7777)) or counts[-1] >= burst,
            timeout=60,
        )
        assert counts[-1] == burst
        gaps = api.get("/flows/gaps", params={"workload": web_id, **_span(began)})["items"]
        assert gaps and {(g["kind"], g["source"]) for g in gaps} == {("source_overrun", "conntrack")}, gaps
        status = web.cli("status", "--state-dir", str(tmp_path / "web")).stdout
        assert re.search(r"conntrack subscribed .*overruns [1-9]", status), status
    finally:
        web.kill()
        serve.stop()
    assert "Traceback" not in web.log(), web.log()


def test_a_table_larger_than_the_dump_bound_is_one_dump_truncated_gap(lab, tmp_path):
    """The table holds entries once the owned table (which uses conntrack) is in the kernel; it stays
    when the agent stops. The next process, bounded to 5 entries at subscribe, says how many it left."""
    from datetime import UTC, datetime, timedelta

    serve = _serve(lab, tmp_path).start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    try:
        api, web_id = _enrolled(serve, web)
        began = datetime.now(UTC) - timedelta(seconds=2)
        web.start("--flow-window-seconds", "2")
        api.wait_converged(web_id)
        sent = lab.python("client", UDP_BURST, WEB, "7777", "20", "21000")  # live for 30 s
        assert sent.returncode == 0, sent.stderr
        web.kill(signal.SIGTERM)
        web.start("--flow-window-seconds", "2", "--flow-dump-max", "5")

        gaps = api.wait_for(
            "a dump_truncated gap",
            lambda: api.get("/flows/gaps", params={"workload": web_id, **_span(began)})["items"],
            timeout=40,
        )
        time.sleep(4)  # two more windows: nothing else may follow
        gaps = api.get("/flows/gaps", params={"workload": web_id, **_span(began)})["items"]
        assert [(g["kind"], g["source"]) for g in gaps] == [("dump_truncated", "conntrack")], gaps
        assert gaps[0]["lost"]["entries"] >= 20 - 5, gaps
    finally:
        web.kill()
        serve.stop()
    assert "Traceback" not in web.log(), web.log()


def test_an_agent_killed_for_longer_than_two_windows_is_one_agent_silent_gap_of_the_silence(lab, tmp_path):
    """SIGKILL: no window is closed, nothing is said. The control plane finds the silence when the next
    process reports: from the start of the window the old process had open at its last sign of life (a
    report or a heartbeat; what it had counted in that window died with it) to the new one's start. A
    connection made just before the kill is counted or lies in the gap: never lost without one."""
    from datetime import UTC, datetime, timedelta

    serve = _serve(lab, tmp_path).start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    flags = ("--flow-window-seconds", "2", "--heartbeat-seconds", "1")
    try:
        api, web_id = _enrolled(serve, web)
        began = datetime.now(UTC) - timedelta(seconds=2)
        web.start(*flags)
        api.wait_converged(web_id)
        assert probe(lab, "client", WEB, 8080) == "open"
        api.wait_for("a first report", lambda: api.workload(web_id)["health"]["telemetry_live"], timeout=30)
        time.sleep(5)  # quiet: only heartbeats of the reporting process (serve writes one a minute)

        # A connection early in a window (they align to the clock), then the kill 1.3 s on, after at
        # least one more heartbeat: the window is still open, and what it counted dies with it.
        time.sleep(2 - time.time() % 2 + 0.05)
        last_connection_at = datetime.now(UTC)
        assert probe(lab, "client", WEB, 8080) == "open"
        time.sleep(1.2)
        killed_at = datetime.now(UTC)
        web.kill(signal.SIGKILL)
        time.sleep(8)  # four windows

        def coverage():
            params = {"workload": web_id, "group_by": "workload", **_span(began)}
            return api.get("/flows/rollup", params=params)["coverage"]

        # Dead, not quiet: no gap is written until it reports again, and the coverage says so meanwhile.
        silent = coverage()
        assert silent["complete"] is False and [w["workload_id"] for w in silent["silent_workloads"]] == [
            web_id
        ], silent
        # Nothing to count after the restart (the probe's connection is gone from the table too): the
        # new process's first report, empty, is what records the silence.
        assert lab.run("web", ["conntrack", "-F"]).returncode == 0
        restarted_at = datetime.now(UTC)
        web.start(*flags)
        api.wait_converged(web_id)

        found = api.wait_for(
            "an agent_silent gap",
            lambda: api.get("/flows/gaps", params={"workload": web_id, **_span(began)})["items"],
            timeout=40,
        )
        assert [(g["kind"], g["source"]) for g in found] == [("agent_silent", None)], found
        (gap,) = found
        silent_from, silent_to = datetime.fromisoformat(gap["start"]), datetime.fromisoformat(gap["end"])
        # From the start of the 2-second window open at its last heartbeat (one a second), which the
        # stream's end recorded.
        assert killed_at - timedelta(seconds=3.5) <= silent_from <= killed_at, (killed_at, gap)
        # The connection in the window that died: not counted, and inside the gap.
        assert _tcp_count(api, web_id, began, 8080) == 1
        assert silent_from <= last_connection_at, (last_connection_at, gap)
        # Up to the new process's start, less what its first window covers (windows align to the clock).
        assert restarted_at - timedelta(seconds=2) <= silent_to <= restarted_at + timedelta(seconds=5), gap
        assert coverage()["silent_workloads"] == []
    finally:
        web.kill()
        serve.stop()


def _sysctl_events(lab, value: int) -> None:
    done = lab.run("web", ["sysctl", "-w", f"net.netfilter.nf_conntrack_events={value}"])
    assert done.returncode == 0, done.stderr


def test_connection_events_switched_off_are_a_conntrack_source_restart_and_the_dump_recovers(lab, tmp_path):
    """The conntrack source torn down from outside: with net.netfilter.nf_conntrack_events=0 the kernel
    sends the agent nothing, and a quiet source would read as a quiet workload. The agent notices when
    it next goes quiet, says why it is down, and subscribes again once events are back: one
    source_restart gap (conntrack) from its last event to then, and the connections opened meanwhile
    and still open are counted by the new subscription's dump, so the totals stay exact."""
    from datetime import UTC, datetime, timedelta

    serve = _serve(lab, tmp_path).start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    burst = 40
    try:
        api, web_id = _enrolled(serve, web)
        web.start("--flow-window-seconds", "2")
        api.wait_converged(web_id)
        began = datetime.now(UTC) - timedelta(seconds=2)
        assert probe(lab, "client", WEB, 8080) == "open"
        api.wait_for("the probe counted", lambda: _tcp_count(api, web_id, began, 8080) == 1, timeout=30)

        switched_off = datetime.now(UTC)
        _sysctl_events(lab, 0)
        sent = lab.python("client", UDP_BURST, WEB, "7777", str(burst), "21000")
        assert sent.returncode == 0, sent.stderr

        def status():
            return web.cli("status", "--state-dir", str(tmp_path / "web")).stdout

        api.wait_for("the source down", lambda: "conntrack DOWN: connection events are off" in status(), 20)
        switched_on = datetime.now(UTC)
        _sysctl_events(lab, 2)
        api.wait_for("the source back", lambda: "conntrack subscribed" in status(), timeout=20)

        api.wait_for(f"{burst} recovered", lambda: _udp_count(api, web_id, began, 7777) >= burst, timeout=30)
        time.sleep(4)  # two more windows: nothing counted twice, no further gap
        assert _udp_count(api, web_id, began, 7777) == burst
        assert _tcp_count(api, web_id, began, 8080) == 1
        gaps = api.get("/flows/gaps", params={"workload": web_id, **_span(began)})["items"]
        assert [(g["kind"], g["source"]) for g in gaps] == [("source_restart", "conntrack")], gaps
        (gap,) = gaps
        start, end = datetime.fromisoformat(gap["start"]), datetime.fromisoformat(gap["end"])
        assert began <= start <= switched_off, (began, gap, switched_off)  # from the last event read
        assert switched_on <= end < switched_on + timedelta(seconds=5), (switched_on, gap)
    finally:
        _sysctl_events(lab, 2)
        web.kill()
        serve.stop()
    assert "Traceback" not in web.log(), web.log()


@contextmanager
def _web_behind_relay(lab, tmp_path):
    """serve with its gateway behind a CUTTING_RELAY in the same namespace (agents are given the
    relay's address), and the web agent enrolled, on 2-second windows and converged. Yields the
    operator API, web's id and a function that gives the relay a command."""
    serve = NamespacedServe(
        lab,
        "cp",
        tmp_path / "cp",
        ["--gateway-advertise", f"{CP}:8443"],
        operator_listen=f"{CP}:8080",
        gateway_listen=f"{CP}:8444",
        migrated=True,
    ).start()
    relay = lab.popen_python("cp", CUTTING_RELAY, f"{CP}:8443", f"{CP}:8444")
    assert relay.stdout.readline().strip() == "ready"

    def relay_told(command: str) -> None:
        relay.stdin.write(command + "\n")
        relay.stdin.flush()
        assert relay.stdout.readline().strip() == "ok"

    web = AgentProcess(lab, "web", tmp_path / "web")
    try:
        api, web_id = _enrolled(serve, web)
        web.start("--flow-window-seconds", "2")
        api.wait_converged(web_id)
        yield api, web_id, web, relay_told
    finally:
        web.kill()
        relay.kill()
        relay.wait(10)
        serve.stop()
    assert "Traceback" not in web.log(), web.log()


def test_a_stream_cut_while_reports_arrive_is_reconnecting_and_no_window_is_lost(lab, tmp_path):
    """A middlebox between the agent and the gateway that ends every connection older than 5 s: the
    sync stream cannot stay up, each flow report (one short connection) still gets through. The API
    shows the spec's Reconnecting (`sync.state` offline, `telemetry_live` true), the review counts the
    workload offline, the connections made meanwhile are counted exactly, and no gap is recorded. An
    agent killed afterwards is offline without telemetry within two of its windows."""
    from datetime import UTC, datetime, timedelta

    with _web_behind_relay(lab, tmp_path) as (api, web_id, web, relay_told):
        began = datetime.now(UTC) - timedelta(seconds=2)
        for _ in range(2):
            assert probe(lab, "client", WEB, 8080) == "open"
        api.wait_for("2 connections counted", lambda: _tcp_count(api, web_id, began, 8080) == 2, timeout=30)

        relay_told("cut 5")
        made = [2]

        def reconnecting():
            # A connection each poll: the agent has something to report, so telemetry stays live.
            assert probe(lab, "client", WEB, 8080) == "open"
            made[0] += 1
            workload = api.workload(web_id)
            return (
                workload["sync"]["state"] == "offline" and workload["health"]["telemetry_live"] and workload
            )

        api.wait_for("Reconnecting: the stream down, telemetry live", reconnecting, timeout=60)
        total = made[0]
        api.wait_for(
            f"{total} connections counted", lambda: _tcp_count(api, web_id, began, 8080) == total, timeout=60
        )

        def offline_in_review():
            review = api.get("/flows/review", params={"workload": web_id, **_span(began)})
            return review["offline_count"] == 1 and review

        review = api.wait_for("the review to count the workload offline", offline_in_review, timeout=60)
        assert review["verdict"] == "fail" and "1 workload is offline" in review["reasons"], review
        assert [w["workload_id"] for w in review["offline"]] == [web_id]

        relay_told("pass")
        api.wait_converged(web_id)
        assert _tcp_count(api, web_id, began, 8080) == total
        assert api.get("/flows/gaps", params={"workload": web_id, **_span(began)})["items"] == []

        web.kill(signal.SIGKILL)

        def offline_without_telemetry():
            workload = api.workload(web_id)
            return workload["sync"]["state"] == "offline" and not workload["health"]["telemetry_live"]

        api.wait_for("offline, telemetry no longer live", offline_without_telemetry, timeout=20)


def test_the_gateway_unreachable_for_several_windows_is_ridden_out_with_the_windows_buffered(lab, tmp_path):
    """Nothing reaches the gateway for longer than two windows while connections are made: the agent
    keeps its windows and sends them late. One process ran throughout, so nothing was silent (rule 2):
    no gap, and the counts are exact."""
    from datetime import UTC, datetime, timedelta

    with _web_behind_relay(lab, tmp_path) as (api, web_id, web, relay_told):
        began = datetime.now(UTC) - timedelta(seconds=2)
        assert probe(lab, "client", WEB, 8080) == "open"
        api.wait_for("1 connection counted", lambda: _tcp_count(api, web_id, began, 8080) == 1, timeout=30)

        relay_told("cut 0")
        api.wait_for(
            "the workload offline, its telemetry no longer live",
            lambda: not api.workload(web_id)["health"]["telemetry_live"],
            timeout=20,
        )
        for _ in range(4):  # over about three windows
            assert probe(lab, "client", WEB, 8080) == "open"
            time.sleep(1)
        assert _tcp_count(api, web_id, began, 8080) == 1  # nothing got through

        relay_told("pass")
        api.wait_for("5 connections counted", lambda: _tcp_count(api, web_id, began, 8080) == 5, timeout=60)
        api.wait_converged(web_id)
        assert api.get("/flows/gaps", params={"workload": web_id, **_span(began)})["items"] == []
        assert api.workload(web_id)["health"]["evidence_gap"] is None


def test_flow_reports_held_back_while_the_stream_stays_up_leave_the_range_incomplete(lab, tmp_path):
    """A middlebox that keeps the sync stream but refuses new connections, which every flow report
    needs: the workload stays synced, its windows wait in the agent's buffer, and its heartbeats say
    since when. Until they arrive the range is not complete and the review fails on it (it would
    otherwise pass with the would-be evidence missing); once they do, the counts are exact, no gap."""
    from datetime import UTC, datetime, timedelta

    with _web_behind_relay(lab, tmp_path) as (api, web_id, web, relay_told):
        began = datetime.now(UTC) - timedelta(seconds=2)
        assert probe(lab, "client", WEB, 8080) == "open"
        api.wait_for("1 connection counted", lambda: _tcp_count(api, web_id, began, 8080) == 1, timeout=30)

        relay_told("hold")
        held_at = datetime.now(UTC)
        for _ in range(3):
            assert probe(lab, "client", WEB, 8080) == "open"

        def pending():
            page = api.get("/flows/rollup", params={"workload": web_id, "group_by": "peer", **_span(began)})
            return page["coverage"]["pending_workloads_count"] == 1 and page["coverage"]

        covered = api.wait_for("the workload named as holding evidence", pending, timeout=30)
        assert covered["complete"] is False
        (held,) = covered["pending_workloads"]
        assert held_at - timedelta(seconds=3) <= datetime.fromisoformat(held["since"]) <= datetime.now(UTC)
        workload = api.workload(web_id)
        assert workload["sync"]["state"] == "synced", workload
        review = api.get("/flows/review", params={"workload": web_id, **_span(began)})
        assert "1 workload holds flow evidence of the range not delivered yet" in review["reasons"], review
        assert _tcp_count(api, web_id, began, 8080) == 1

        relay_told("pass")
        api.wait_for("4 connections counted", lambda: _tcp_count(api, web_id, began, 8080) == 4, timeout=60)

        def delivered():
            page = api.get("/flows/rollup", params={"workload": web_id, "group_by": "peer", **_span(began)})
            return page["coverage"]["pending_workloads_count"] == 0 and page["coverage"]

        assert api.wait_for("its backlog delivered", delivered, timeout=30)["complete"] is True
        assert api.get("/flows/gaps", params={"workload": web_id, **_span(began)})["items"] == []


def test_a_mode_change_the_agent_has_not_applied_fails_the_review_on_what_its_table_decided(lab, tmp_path):
    """The workload put in simulation while its agent cannot reach the gateway: its mode says
    simulation from that instant, but its table still observes (visibility) until the agent applies
    the change. The review over the range from the change fails on the connections that table
    decided: what simulation would have said of them is unknown."""
    from datetime import UTC, datetime

    with _web_behind_relay(lab, tmp_path) as (api, web_id, web, relay_told):
        relay_told("cut 0")
        api.wait_for(
            "the workload offline", lambda: api.workload(web_id)["sync"]["state"] == "offline", timeout=20
        )
        changed = api.post("/mode-changes", {"selection": {"workload_ids": [web_id]}, "mode": "simulation"})
        assert changed.status_code in (200, 201, 202), changed.text
        since = datetime.fromisoformat(api.workload(web_id)["mode_since"])
        for _ in range(3):
            assert probe(lab, "client", WEB, 8080) == "open"
        relay_told("pass")
        api.wait_converged(web_id)
        assert probe(lab, "client", WEB, 8080) == "open"  # judged by the simulation table
        span = {**_span(since), "from": since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}

        def decided():
            review = api.get("/flows/review", params={"workload": web_id, **span})
            return sum(r["connection_count"] for r in review["decided_outside_simulation"]) == 3 and review

        review = api.wait_for("the visibility table's 3 connections in the review", decided, timeout=60)
        assert review["verdict"] == "fail" and review["not_in_simulation_count"] == 0, review
        assert review["decided_outside_simulation"] == [
            {"workload_id": web_id, "decision": "observed", "connection_count": 3}
        ]
        assert (
            "1 workload's table decided connections in the range outside simulation (observed or blocked)"
            in review["reasons"]
        )


FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"


def test_an_agent_clock_a_day_behind_still_connects_is_marked_skewed_and_then_cleared(lab, tmp_path):
    """The agent's clock set a day back (libfaketime; its monotonic clock untouched): the gateway's
    certificate, made an hour ago by the control plane's clock, is not valid yet by the agent's, and
    the pin still lets it connect. Its windows carry its own clock's times, its reports mark the
    workload with the measured offset, and a report from a correct clock clears it."""
    from datetime import UTC, datetime, timedelta
    from pathlib import Path

    from tests.support.requirements import require

    require(Path(FAKETIME).exists(), f"needs libfaketime ({FAKETIME}): apt install faketime")
    day_behind = {"LD_PRELOAD": FAKETIME, "FAKETIME": "-1d", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    serve = _serve(lab, tmp_path).start()
    web = AgentProcess(lab, "web", tmp_path / "web")
    try:
        api, web_id = _enrolled(serve, web)
        web.start("--flow-window-seconds", "2", env=day_behind)
        api.wait_converged(web_id)
        assert probe(lab, "client", WEB, 8080) == "open"

        def skew():
            return api.workload(web_id)["health"]["clock_skew"]

        found = api.wait_for("the clock skew measured", skew, timeout=30)
        assert -86400 - 60 < found["offset_seconds"] < -86400 + 60, found
        since = datetime.now(UTC) - timedelta(days=1, minutes=5)  # the windows carry the agent's times
        api.wait_for("the connection counted", lambda: _tcp_count(api, web_id, since, 8080) == 1, timeout=30)
        today = datetime.now(UTC) - timedelta(hours=1)
        assert _tcp_count(api, web_id, today, 8080) == 0

        web.kill(signal.SIGTERM)
        # The first connection gone from the table, so the new process's dump does not count it again.
        assert lab.run("web", ["conntrack", "-F"]).returncode == 0
        web.start("--flow-window-seconds", "2")
        assert probe(lab, "client", WEB, 8080) == "open"
        api.wait_for("the skew cleared", lambda: skew() is None, timeout=30)
        api.wait_for("today's connection", lambda: _tcp_count(api, web_id, today, 8080) == 1, timeout=30)
    finally:
        web.kill()
        serve.stop()
    assert "Traceback" not in web.log(), web.log()

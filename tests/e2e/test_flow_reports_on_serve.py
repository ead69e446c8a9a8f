"""Flow reports through the real serve over TLS: an enrolled agent's signed report of windows and gaps
is stored once, answered per window, and read back through the operator API.

The windows come from the agent's own aggregation and buffer (agent/flowwindow.py, agent/flowbuffer.py)
and the body and signature from agent/flowreport.py; what is not here yet is a flow source feeding them.
"""

from __future__ import annotations

import json
import math
import uuid

import pytest

from agent.enrol import enrol
from agent.flowbuffer import FlowBuffer
from agent.flowreport import instant, report_body
from agent.flowwindow import FlowKey, Windows
from agent.state import StateDir
from tests.support.flow_reports import post_flow_report
from tests.support.serve_process import Site

pytestmark = pytest.mark.e2e

T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z, on a minute boundary
RANGE = {"from": instant(T0 - 3600), "to": instant(T0 + 3600)}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("flows")
    with Site.fresh(root / "data", migrated=True) as site:
        serve = site.serve()
        operator = serve.client(
            "operator", headers={"Authorization": f"Bearer {serve.mint_operator_token()}"}
        )
        bundle = operator.post(
            "/api/v1/provisioning-tokens", json={"description": "flows", "max_uses": 2}
        ).json()
        enrol(bundle["bundle"], str(root / "web"), hostname="web", addresses=["10.50.0.1"])
        enrol(bundle["bundle"], str(root / "client"), hostname="client", addresses=["10.50.0.2"])
        agent = StateDir(root / "web").load_enrolment()
        client_id = StateDir(root / "client").load_identity().workload_id
        yield serve, operator, agent, client_id, root
        operator.close()
        assert serve.stop() == 0
        assert "Traceback" not in serve.stderr_text()


def _post(serve, agent, body: bytes, **overrides):
    return post_flow_report(serve, agent, body, **overrides)


def _buffered(root, name: str):
    w = Windows(length=60, max_keys=100, accounting=True)
    web = FlowKey("10.50.0.2", "tcp", 443, "allowed", 7)
    stranger = FlowKey("192.0.2.9", "tcp", 22, "would_block", None)
    for at in (T0 + 1, T0 + 2, T0 + 61):
        w.connection_opened(web, at)
    w.connection_opened(stranger, T0 + 5)
    w.bytes_counted(web, T0 + 70, bytes_in=100, bytes_out=2000)
    closed, gaps = w.close_due(math.inf, "v-test")
    buffer = FlowBuffer(root / name, max_records=1)  # holds one window: the first overflows
    buffer.add(closed, gaps)
    return buffer


def _body(windows, gaps) -> bytes:
    return report_body(
        windows, gaps, now=T0 + 130, process_start_id="p1", uptime_seconds=130.0, window_seconds=60
    )


def test_a_report_is_stored_once_and_read_back(lab):
    serve, operator, agent, client_id, root = lab
    (root / "buffer-a").mkdir()
    buffer = _buffered(root, "buffer-a")
    windows, gaps = buffer.pending()
    assert len(windows) == 1 and [g["kind"] for g in gaps] == ["buffer_overflow"]
    body = _body(windows, gaps)

    answer = _post(serve, agent, body)
    assert answer.status_code == 200, answer.text
    results = answer.json()
    assert [r["result"] for r in results["windows"] + results["gaps"]] == ["accepted", "accepted"]
    again = _post(serve, agent, body)  # the acknowledgement was lost: the agent sends it again
    assert again.json() == results

    page = operator.get("/api/v1/flows", params={"workload": agent.identity.workload_id, **RANGE}).json()
    assert [w["id"] for w in page["items"]] == [windows[0]["id"]]  # stored once
    window = page["items"][0]
    assert (window["start"], window["end"]) == ("2027-01-15T08:01:00.000000Z", "2027-01-15T08:02:00.000000Z")
    (group,) = window["groups"]
    assert group["peer"] == "10.50.0.2" and group["peer_workload_id"] == client_id
    assert (group["connection_count"], group["bytes_in"], group["bytes_out"]) == (1, 100, 2000)
    assert (group["decision"], group["rule_number"], group["rule_id"]) == ("allowed", 7, None)

    gaps_page = operator.get(
        "/api/v1/flows/gaps", params={"workload": agent.identity.workload_id, **RANGE}
    ).json()
    assert [(g["kind"], g["source"], g["lost"]) for g in gaps_page["items"]] == [
        ("buffer_overflow", None, {"windows": 1})
    ]
    workload = operator.get(f"/api/v1/workloads/{agent.identity.workload_id}").json()
    assert workload["health"]["telemetry_live"] is True


def test_a_malformed_window_is_refused_with_its_reason_and_the_rest_lands(lab):
    serve, operator, agent, _, root = lab
    good = {
        "id": str(uuid.uuid4()),
        "start": T0 + 600,
        "end": T0 + 660,
        "policy_version": "v",
        "accounting": False,
        "groups": [
            {"peer": "10.50.0.9", "protocol": "udp", "port": 53, "decision": "observed", "rule": None,
             "connection_count": 2, "first_seen": T0 + 601, "last_seen": T0 + 602, "bytes_in": 0, "bytes_out": 0}
        ],
    }  # fmt: skip
    bad = {**good, "id": str(uuid.uuid4()), "end": T0 + 700}  # not one window long
    bytes_without_accounting = {
        **good,
        "id": str(uuid.uuid4()),
        "groups": [{**good["groups"][0], "bytes_in": 5}],
    }
    answer = _post(serve, agent, _body([good, bad, bytes_without_accounting], []))
    assert answer.status_code == 200, answer.text
    results = answer.json()["windows"]
    assert [r["result"] for r in results] == ["accepted", "refused", "refused"]
    assert "60 s long" in results[1]["reason"] and "accounting" in results[2]["reason"]
    stored = operator.get("/api/v1/flows", params={"workload": agent.identity.workload_id, **RANGE}).json()
    assert good["id"] in {w["id"] for w in stored["items"]}
    assert not {bad["id"], bytes_without_accounting["id"]} & {w["id"] for w in stored["items"]}


@pytest.mark.parametrize("tamper", ["signature", "credential", "body", "workload"])
def test_a_report_not_signed_by_the_workload_is_refused(lab, tamper):
    serve, operator, agent, client_id, _ = lab
    body = _body([], [])
    overrides = {}
    if tamper == "signature":
        overrides["Palisade-Signature"] = "A" * 86 + "=="
    elif tamper == "credential":
        overrides["Palisade-Credential"] = agent.credential[:-4] + "AAAA"
    elif tamper == "workload":
        overrides["Palisade-Workload"] = client_id  # another workload's id with this one's key
    answer = (
        _post(serve, agent, body, **overrides)
        if tamper != "body"
        else _post_tampered_body(serve, agent, body)
    )
    assert answer.status_code == 401
    assert answer.headers["content-type"] == "application/problem+json"
    assert json.loads(answer.text)["type"] == "urn:service:problem:unauthenticated"


def _post_tampered_body(serve, agent, body: bytes):
    return post_flow_report(serve, agent, body, sent=body.replace(b'"p1"', b'"p2"'))


def test_flow_reads_refuse_bad_ranges(lab):
    _, operator, agent, _, _ = lab
    workload = agent.identity.workload_id
    for params in ({"workload": workload}, {"workload": workload, "from": RANGE["to"], "to": RANGE["from"]},
                   {"workload": workload, "from": instant(T0), "to": instant(T0 + 40 * 86400)}, RANGE):  # fmt: skip
        answer = operator.get("/api/v1/flows", params=params)
        assert answer.status_code == 422, (params, answer.text)


def test_a_window_with_many_keys_is_larger_than_the_api_limit_and_still_lands(lab):
    """A busy host's window of 20,000 keys is about 5 MB: over the API's 1 MiB bodies, under the
    gateway's limit for flow reports."""
    serve, operator, agent, _, root = lab
    w = Windows(length=60, max_keys=100_000, accounting=False)
    for i in range(20_000):
        w.connection_opened(
            FlowKey(f"10.60.{i // 256}.{i % 256}", "tcp", 443, "observed", None), T0 + 1200 + 1
        )
    closed, _ = w.close_due(math.inf, "v")
    (root / "buffer-big").mkdir()
    buffer = FlowBuffer(root / "buffer-big", max_records=10)
    buffer.add(closed, [])
    body = _body(*buffer.pending())
    assert len(body) > 1024 * 1024
    answer = _post(serve, agent, body)
    assert answer.status_code == 200, answer.text[:500]
    assert [r["result"] for r in answer.json()["windows"]] == ["accepted"]


def test_a_signed_report_replayed_verbatim_moves_neither_liveness_nor_the_clock_skew(lab):
    """Windows of one second, so that a replay three seconds on is past telemetry_live's two windows
    and would read as a clock three seconds behind (over two windows) if it were taken as news."""
    import time

    serve, operator, _, client_id, root = lab
    client = StateDir(root / "client").load_enrolment()
    body = report_body(
        [], [], now=time.time(), process_start_id="replayed", uptime_seconds=50.0, window_seconds=1
    )
    assert _post(serve, client, body).status_code == 200
    health = operator.get(f"/api/v1/workloads/{client_id}").json()["health"]
    assert health["clock_skew"] is None
    time.sleep(3)
    assert _post(serve, client, body).status_code == 200  # stored once, answered as before
    health = operator.get(f"/api/v1/workloads/{client_id}").json()["health"]
    assert health["telemetry_live"] is False and health["clock_skew"] is None


def test_serves_own_answer_to_a_report_is_the_one_django_gives(lab):
    """serve answers a plain flow report without Django's handler stack (controlplane/gateway_reports.py);
    a request with a browser's headers goes through Django, the view and every middleware. The two
    answers are the same: status, document and headers, for a report stored and for one refused whole."""
    serve, _, agent, _, _ = lab
    window = {
        "id": str(uuid.uuid4()), "start": T0 + 1200, "end": T0 + 1260, "policy_version": "v", "accounting": False,
        "groups": [{"peer": "10.50.0.9", "protocol": "tcp", "port": 22, "decision": "allowed", "rule": 3,
                    "connection_count": 1, "first_seen": T0 + 1201, "last_seen": T0 + 1201, "bytes_in": 0,
                    "bytes_out": 0}],
    }  # fmt: skip
    body = _body([window], [])
    through_django = {"Sec-Fetch-Site": "same-origin"}  # passes the cross-origin guard, not the fast way
    for extra in ({}, {"Palisade-Signature": "A" * 86 + "=="}):
        ours = _post(serve, agent, body, **extra)
        django = _post(serve, agent, body, **extra, **through_django)
        assert ours.status_code == django.status_code == (200 if not extra else 401), ours.text
        assert ours.json() == django.json()
        assert _headers(ours) == _headers(django)


def _headers(answer) -> dict:
    return {k: v for k, v in answer.headers.items() if k not in ("date", "server", "content-length")}

"""Ingestion of flow reports and the reads of stored evidence, in process (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.credential import public_key_encode
from agent.flowreport import report_body, report_headers
from controlplane import clock, runtime
from controlplane.problems import Problem, ValidationFailed
from fleet.report_auth import report_sender_authenticate, report_signature_verify
from flows.models import EvidenceGap, FlowGroup, FlowWindow, UnsummedWindow
from flows.services import flow_report_ingest
from tests.support.flow_evidence import GOLDEN, at_agent_clock, enrolled, flow_report, golden, windows_between
from tests.support.helpers import assert_problem, race

FINGERPRINT = ":".join(["CD"] * 32)
T0 = 1_800_000_000.0


def test_the_golden_report_is_what_the_agent_writes_and_what_the_gateway_stores(db):
    data = golden()
    windows = [
        {
            **w,
            "start": T0,
            "end": T0 + 60,
            "groups": [
                {**g, "first_seen": _seconds(g["first_seen"]), "last_seen": _seconds(g["last_seen"])}
                for g in w["groups"]
            ],
        }
        for w in data["windows"]
    ]
    gaps = [{**g, "start": _seconds(g["start"]), "end": _seconds(g["end"])} for g in data["gaps"]]
    body = report_body(
        windows, gaps, now=T0 + 61, process_start_id="9b2f6c1e", uptime_seconds=3600.25, window_seconds=60
    )
    assert body + b"\n" == GOLDEN.read_bytes()

    workload, _, _ = enrolled()
    answer = flow_report_ingest(workload_id=str(workload.id), data=at_agent_clock(data, clock.now()))
    assert [r["result"] for r in answer["windows"] + answer["gaps"]] == ["accepted", "accepted"]
    assert (
        FlowWindow.objects.count() == 1
        and FlowGroup.objects.count() == 2
        and EvidenceGap.objects.count() == 1
    )


def _seconds(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@pytest.mark.parametrize(
    "change, path",
    [
        ({"v": 2}, "/type"),
        ({"agent_clock": "yesterday"}, "/agent_clock"),
        ({"window_seconds": 0}, "/window_seconds"),
        ({"windows": {}}, "/windows"),
        ({"extra": 1}, "/extra"),
    ],
)
def test_a_malformed_envelope_is_a_validation_problem(db, change, path):
    workload, _, _ = enrolled()
    with pytest.raises(ValidationFailed) as refused:
        flow_report_ingest(workload_id=str(workload.id), data={**golden(), **change})
    assert path in [finding.path for finding in refused.value.findings]


def test_clock_skew_marks_the_workload_and_a_later_report_clears_it(api, db):
    workload, _, _ = enrolled()
    data = golden()
    flow_report_ingest(
        workload_id=str(workload.id), data=at_agent_clock(data, clock.now() + timedelta(minutes=5))
    )
    health = api.get(f"/api/v1/workloads/{workload.id}").json()["health"]
    assert 295 <= health["clock_skew"]["offset_seconds"] <= 305
    assert health["evidence_gap"]["kind"] == "source_overrun"
    later = {**data, "uptime_seconds": data["uptime_seconds"] + 1, "windows": [], "gaps": []}
    flow_report_ingest(workload_id=str(workload.id), data=at_agent_clock(later, clock.now()))
    health = api.get(f"/api/v1/workloads/{workload.id}").json()["health"]
    assert health["clock_skew"] is None and health["evidence_gap"]["kind"] == "source_overrun"
    assert health["telemetry_live"] is True
    workload.refresh_from_db()
    assert workload.flow_window_seconds == data["window_seconds"]  # telemetry_live counts two of these


def _signed_delivery(workload, key, credential, body: bytes) -> dict:
    """What the gateway does with a report (flows/gateway.py): check its signature, then store it."""
    signature = report_headers(
        body, key=key, workload_id=str(workload.id), credential=credential, gateway_fingerprint=FINGERPRINT
    )["Palisade-Signature"]
    sender = report_sender_authenticate(workload_id=str(workload.id), credential=credential)
    report_signature_verify(sender=sender, signature=signature, body=body)
    return flow_report_ingest(workload_id=str(sender.workload_id), data=json.loads(body))


def test_a_signed_report_replayed_later_moves_neither_liveness_nor_the_clock_skew(api, db, clock_at):
    runtime.facts_set(gateway_fingerprint=FINGERPRINT)
    workload, key, credential = enrolled()
    health = lambda: api.get(f"/api/v1/workloads/{workload.id}").json()["health"]  # noqa: E731
    captured = json.dumps(flow_report("p1", 100.0, windows_between(clock.now(), 1))).encode()
    _signed_delivery(workload, key, credential, captured)
    assert health()["telemetry_live"] is True and health()["clock_skew"] is None
    workload.refresh_from_db()
    reported_at = workload.last_flow_report_at

    clock_at(timedelta(minutes=5))
    assert health()["telemetry_live"] is False
    answer = _signed_delivery(workload, key, credential, captured)  # the same bytes, signature and all
    assert [r["result"] for r in answer["windows"]] == ["accepted"] and FlowWindow.objects.count() == 1
    assert health()["telemetry_live"] is False and health()["clock_skew"] is None  # not -300 s
    workload.refresh_from_db()
    assert workload.last_flow_report_at == reported_at and workload.flow_process_alive_at == reported_at

    # The agent's own next report (its process older by now) is news; so is a restarted process's.
    _signed_delivery(workload, key, credential, json.dumps(flow_report("p1", 400.0)).encode())
    assert health()["telemetry_live"] is True
    clock_at(timedelta(minutes=5))
    _signed_delivery(workload, key, credential, json.dumps(flow_report("p2", 10.0)).encode())
    clock_at(timedelta(minutes=5))
    silences = _silent()  # p1 silent from its last report to p2's start
    # A report of the process before it, however late and whatever its uptime, is not.
    _signed_delivery(workload, key, credential, captured)
    _signed_delivery(workload, key, credential, json.dumps(flow_report("p1", 9000.0)).encode())
    workload.refresh_from_db()
    assert workload.flow_process_start_id == "p2" and workload.clock_skew_seconds is None
    assert health()["telemetry_live"] is False
    assert _silent() == silences  # nor is it a restart after a silence


@pytest.mark.postgres
def test_concurrent_resends_store_a_window_once(transactional_db):
    from django.db import connection

    from tests.support.requirements import require

    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    workload, _, _ = enrolled()
    data = at_agent_clock(golden(), clock.now())
    results = race(*[lambda: flow_report_ingest(workload_id=str(workload.id), data=data) for _ in range(4)])
    assert not [r for r in results if isinstance(r, Exception)], results
    assert (
        FlowWindow.objects.count() == 1
        and FlowGroup.objects.count() == 2
        and EvidenceGap.objects.count() == 1
    )


@pytest.mark.postgres
def test_a_writes_rows_go_to_postgresql_as_json_and_come_back_exactly(db):
    """`_windows_and_workloads_write` sends its rows as JSON read by `json_to_recordset`: each value,
    floats to the last bit, instants to the microsecond in any offset, text with quotes and escapes,
    and nulls, must come back as the value sent."""
    from datetime import UTC, timezone

    from django.db import connection

    from flows.services import _json_rows
    from tests.support.requirements import require

    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    row = {
        "id": uuid.uuid4(),
        "at": datetime(2026, 11, 29, 12, 0, 0, 123457, tzinfo=timezone(timedelta(hours=-7, minutes=-30))),
        "utc": datetime(2026, 11, 29, 23, 59, 59, 999999, tzinfo=UTC),
        "f": 0.1 + 0.2,
        "tiny": 5e-324,
        "n": 2**31 - 1,
        "t": 'a "quoted" \\ back\nslash \u00e9\u2028',
        "none": None,
        "b": True,
    }
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT * FROM json_to_recordset(%s::json) AS r(id uuid, at timestamptz, utc timestamptz,"
            " f double precision, tiny double precision, n integer, t text, none timestamptz, b boolean)",
            [_json_rows([row])],
        )
        assert cursor.fetchall() == [tuple(row.values())]


def test_flows_filters_and_refusals(api, db):
    workload, _, _ = enrolled()
    flow_report_ingest(workload_id=str(workload.id), data=at_agent_clock(golden(), clock.now()))
    base = {"workload": str(workload.id), "from": "2027-01-15T07:00:00Z", "to": "2027-01-15T09:00:00Z"}

    def peers(**filters):
        page = api.get("/api/v1/flows", {**base, **filters}).json()
        return [g["peer"] for w in page["items"] for g in w["groups"]]

    assert peers() == ["10.50.0.2", "2001:db8::9"]
    assert peers(decision="would_block") == ["2001:db8::9"]
    assert peers(service="tcp/443") == ["10.50.0.2"] and peers(service="udp/80") == []
    assert peers(peer="2001:db8:0::9") == ["2001:db8::9"]
    assert peers(peer="::ffff:10.50.0.2") == ["10.50.0.2"]  # as ingestion stores an IPv4-mapped peer
    assert peers(rule="7") == ["10.50.0.2"]
    for bad in (
        {"decision": "maybe"},
        {"service": "sctp/1"},
        {"peer": "host"},
        {"rule": "x"},
        {"workload": ""},
        *({"service": service} for service in ("tcp", "tcp/", "icmp/5", "tcp/0", "tcp/0443", "udp/65536")),
        *({"limit": limit} for limit in ("+5", " 5", "5_0", "\u0665", "0")),
    ):
        assert_problem(api.get("/api/v1/flows", {**base, **bad}), 422, "validation")
    # Every bad parameter at once, each with its own finding: fixed in one round.
    every = {"workload": "", "from": "yesterday", "to": base["to"], "limit": "x", "peer": "fe80::1%eth0",
             "service": "tcp"}  # fmt: skip
    found = assert_problem(api.get("/api/v1/flows", every), 422, "validation")["errors"]
    assert {(e["path"], e["rule"]) for e in found} == {
        ("?from", "instant"), ("?limit", "type"), ("?peer", "address-zone"), ("?service", "service"),
        ("?workload", "required"),
    }  # fmt: skip
    every = {"from": "yesterday", "to": base["to"], "limit": "0", "group_by": "colour", "label": "=x"}
    found = assert_problem(api.get("/api/v1/flows/rollup", every), 422, "validation")["errors"]
    assert {e["path"] for e in found} == {"?from", "?limit", "?group_by[0]", "?label[0]"}
    assert_problem(
        api.get("/api/v1/flows", {**base, "workload": "00000000-0000-0000-0000-000000000000"}),
        404,
        "not-found",
    )


def test_retention_removes_old_evidence(db, clock_at):
    from controlplane.housekeeping import flows_prune_step

    workload, _, _ = enrolled()
    import uuid

    from flows.models import FlowBlock, FlowHour, FlowQuarter
    from flows.sums.writes import flow_windows_sum

    flow_report_ingest(workload_id=str(workload.id), data=at_agent_clock(golden(), clock.now()))
    assert flows_prune_step() == 0
    flow_windows_sum(before=clock.now() + timedelta(days=3650))  # into its hour and block
    another = at_agent_clock(golden(), clock.now())
    another["windows"] = [{**another["windows"][0], "id": str(uuid.uuid4())}]
    flow_report_ingest(workload_id=str(workload.id), data=another)  # not summed yet
    sums = (FlowQuarter, FlowHour, FlowBlock)
    assert all(model.objects.exists() for model in sums) and UnsummedWindow.objects.exists()
    clock_at(timedelta(days=400))  # the golden window is from 2027-01-15
    runtime.facts_set(flow_retention_days=30)
    assert flows_prune_step() > 0  # on PostgreSQL whole day partitions, on SQLite rows
    assert FlowWindow.objects.count() == FlowGroup.objects.count() == EvidenceGap.objects.count() == 0
    assert not any(model.objects.exists() for model in sums)
    assert not UnsummedWindow.objects.exists()  # nor is a dropped window summed later


def test_a_report_needs_the_workloads_key_and_a_live_credential(db, clock_at):
    runtime.facts_set(gateway_fingerprint=FINGERPRINT)
    workload, key, credential = enrolled()
    body = GOLDEN.read_bytes()
    headers = report_headers(
        body, key=key, workload_id=str(workload.id), credential=credential, gateway_fingerprint=FINGERPRINT
    )
    signature = headers["Palisade-Signature"]
    sender = report_sender_authenticate(workload_id=str(workload.id), credential=credential)
    assert sender.workload_id == workload.id
    report_signature_verify(sender=sender, signature=signature, body=body)
    with pytest.raises(Problem, match="enrolled workload"):
        report_signature_verify(sender=sender, signature=signature, body=body + b" ")
    other, _, other_credential = enrolled(hostname="db", address="10.50.0.2")
    with pytest.raises(
        Problem, match="enrolled workload"
    ):  # another's credential, its own key: not this body
        report_signature_verify(
            sender=report_sender_authenticate(workload_id=str(other.id), credential=other_credential),
            signature=signature,
            body=body,
        )
    # Past expiry within the grace, the agent renews on the stream; beyond it, it cannot: re-enrol.
    clock_at(workload.credential_expires_at - clock.now() + timedelta(seconds=1))
    with pytest.raises(Problem, match="renew it on the sync stream") as refused:
        report_sender_authenticate(workload_id=str(workload.id), credential=credential)
    assert refused.value.name == "unauthenticated"
    clock_at(timedelta(days=400))
    with pytest.raises(Problem, match="beyond its renewal grace and cannot be renewed: re-enrol") as refused:
        report_sender_authenticate(workload_id=str(workload.id), credential=credential)
    assert refused.value.name == "unauthenticated" and "renew it" not in refused.value.detail


def test_a_reports_headers_alone_refuse_a_sender_that_is_not_a_workload_with_its_current_credential(db):
    """What serve checks before it receives the body (controlplane/body_gate.py), and the view again."""
    from django.utils.datastructures import CaseInsensitiveMapping

    from agent.credential import credential_parse, credential_payload, credential_sign
    from fleet.credentials import signing_key
    from flows.gateway import report_sender_of

    workload, key, credential = enrolled()
    other, _, other_credential = enrolled(hostname="db", address="10.50.0.2")
    current = credential_parse(credential)
    now = clock.now()

    def ours(**changes) -> str:  # signed by this control plane, so valid-looking
        fields = {**{k: current[k] for k in ("workload_id", "public_key", "serial")}, **changes}
        fields.update(issued_at=now - timedelta(days=1), expires_at=now + timedelta(days=1))
        return credential_sign(credential_payload(**fields), signing_key())

    good = {
        "palisade-workload": str(workload.id),
        "Palisade-Credential": credential,
        "Palisade-Signature": "x",
    }
    assert report_sender_of(CaseInsensitiveMapping(good)).workload_id == workload.id  # any case of the names
    refused = [
        ({"Palisade-Credential": "not a credential"}, "enrolled workload"),
        ({"Palisade-Credential": credential[:-8] + "AAAAAAA="}, "enrolled workload"),  # signature altered
        ({"Palisade-Credential": other_credential}, "enrolled workload"),
        ({"Palisade-Credential": ours(serial=current["serial"] + 1)}, "enrolled workload"),
        ({"Palisade-Credential": ours(public_key=public_key_encode(Ed25519PrivateKey.generate().public_key()))},
         "enrolled workload"),
        ({"palisade-workload": str(uuid.uuid4())}, "enrolled workload"),
        ({"palisade-workload": "not-a-uuid"}, "enrolled workload"),
        ({"palisade-workload": str(other.id)}, "enrolled workload"),
        ({"Palisade-Signature": ""}, "Palisade-Signature"),
        ({"Palisade-Credential": ""}, "Palisade-Credential"),
    ]  # fmt: skip
    for change, message in refused:
        with pytest.raises(Problem, match=message) as refusal:
            report_sender_of(CaseInsensitiveMapping({**good, **change}))
        assert refusal.value.name == "unauthenticated", change


def test_the_flows_command_lists_windows_and_gaps_as_table_json_and_csv(db):
    import csv
    import io

    from tests.support.helpers import run_command

    workload, _, _ = enrolled()
    flow_report_ingest(workload_id=str(workload.id), data=at_agent_clock(golden(), clock.now()))
    window = ("--from", "2027-01-15T07:00:00Z", "--to", "2027-01-15T09:00:00Z")
    code, out, _ = run_command("flows", "list", "--workload", str(workload.id), *window, "--csv")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [(r["peer"], r["decision"], r["connection_count"]) for r in rows] == [
        ("10.50.0.2", "allowed", "3"),
        ("2001:db8::9", "would_block", "1"),
    ]
    code, out, _ = run_command("flows", "gaps", *window, "--json")
    assert code == 0 and [g["kind"] for g in json.loads(out)["items"]] == ["source_overrun"]
    assert json.loads(out)["next_cursor"] is None  # the API's document: every page, no cursor left
    lost = json.loads(out)["items"][0]["lost"]
    code, out, _ = run_command("flows", "gaps", *window, "--csv")
    (row,) = csv.DictReader(io.StringIO(out))
    assert json.loads(row["lost"]) == lost  # JSON in its cell, as the API gives it
    code, out, _ = run_command(
        "flows", "list", "--workload", str(workload.id), *window, "--decision", "blocked"
    )
    assert code == 0 and len(out.strip().splitlines()) == 1  # the header alone
    code, _, err = run_command("flows", "gaps", "--from", "nonsense", "--to", "2027-01-15T09:00:00Z")
    assert code == 2 and "from" in err


def _silent():
    return [(g.start, g.end) for g in EvidenceGap.objects.filter(kind="agent_silent")]


def test_a_quiet_workload_records_no_agent_silent(db, clock_at):
    workload, _, _ = enrolled()
    flow_report_ingest(workload_id=str(workload.id), data=flow_report("p1", 100))
    clock_at(timedelta(minutes=30))
    flow_report_ingest(
        workload_id=str(workload.id), data=flow_report("p1", 1900)
    )  # the same process throughout
    assert _silent() == []


def test_a_restart_after_a_silence_records_agent_silent_up_to_the_new_process(db, clock_at):
    workload, _, _ = enrolled()
    flow_report_ingest(workload_id=str(workload.id), data=flow_report("p1", 100))
    last_report = clock.now()
    clock_at(timedelta(minutes=10))
    flow_report_ingest(workload_id=str(workload.id), data=flow_report("p2", 30))
    (gap,) = EvidenceGap.objects.filter(kind="agent_silent")
    # From the start of the window p1 had open then: killed, it lost what it had counted in it.
    assert gap.start == last_report.replace(second=0, microsecond=0)
    assert abs(gap.end - (clock.now() - timedelta(seconds=30))) < timedelta(seconds=1)
    assert gap.source is None


def test_heartbeats_of_the_old_process_and_late_windows_shorten_the_silence(db, clock_at):
    from fleet import sync

    workload, _, _ = enrolled()
    sync.workload_stream_opened(workload_id=workload.id, stream_id="s1")
    flow_report_ingest(workload_id=str(workload.id), data=flow_report("p1", 100))
    clock_at(timedelta(minutes=8))
    sync.workload_heard_from(workload_id=workload.id, stream_id="s1", process_start_id="p1")
    clock_at(timedelta(minutes=2))
    # Restarted 30 s ago: 8 min of heartbeats, then 90 s unexplained: under two windows, no gap.
    flow_report_ingest(workload_id=str(workload.id), data=flow_report("p2", 30))
    assert _silent() == []

    alive = clock.now()
    clock_at(timedelta(minutes=20))
    # The agent buffered windows through most of the outage and re-sends them after its restart.
    held_back = windows_between(alive, 15)
    flow_report_ingest(workload_id=str(workload.id), data=flow_report("p3", 10, held_back))
    gaps = _silent()
    assert len(gaps) == 1
    start, end = gaps[0]
    assert start == datetime.fromisoformat(held_back[-1]["end"].replace("Z", "+00:00"))
    assert abs(end - (clock.now() - timedelta(seconds=10))) < timedelta(seconds=1)


def test_a_stream_ending_records_its_last_heartbeat_so_the_silence_starts_there(db, clock_at):
    """Heartbeats are written at most once a minute; the stream's end carries the last one it got."""
    from fleet import sync

    workload, _, _ = enrolled()
    sync.workload_stream_opened(workload_id=workload.id, stream_id="s1")
    clock_at(
        timedelta(seconds=(30 - clock.now().second) % 60)
    )  # the report at :30, the heartbeat in the next minute
    flow_report_ingest(workload_id=str(workload.id), data=flow_report("p1", 100))
    clock_at(timedelta(seconds=50))
    last_heartbeat = clock.now()  # not written: under a minute since the last write
    clock_at(timedelta(seconds=5))
    sync.workload_stream_ended(workload_id=workload.id, stream_id="s1", last_heartbeat=("p1", last_heartbeat))
    clock_at(timedelta(minutes=10))
    flow_report_ingest(workload_id=str(workload.id), data=flow_report("p2", 30))
    ((start, end),) = _silent()
    assert start == last_heartbeat.replace(second=0, microsecond=0)  # the window open at the heartbeat
    # Another process's heartbeat says nothing of the one that reported (p2).
    workload.refresh_from_db()
    reported_at = workload.flow_process_alive_at
    sync.workload_stream_opened(workload_id=workload.id, stream_id="s2")
    clock_at(timedelta(minutes=1))
    sync.workload_stream_ended(workload_id=workload.id, stream_id="s2", last_heartbeat=("p9", clock.now()))
    workload.refresh_from_db()
    assert workload.flow_process_alive_at == reported_at


def test_odd_ids_and_peers_are_refused_per_window(db):
    workload, _, _ = enrolled()
    data = at_agent_clock(golden(), clock.now())
    window = data["windows"][0]
    odd = [
        {**window, "id": 7},
        {**window, "id": "not-a-uuid"},
        {**window, "id": "0c1d2e3f-4a5b-4c6d-8e7f-9a0b1c2d3e4f", "groups": [{**window["groups"][0], "peer": "fe80::1%eth0"}]},
    ]  # fmt: skip
    answer = flow_report_ingest(workload_id=str(workload.id), data={**data, "windows": odd, "gaps": []})
    assert [(r["result"], r["reason"][:14]) for r in answer["windows"]] == [
        ("refused", "id is not a UU"),
        ("refused", "id is not a UU"),
        ("refused", "peer carries a"),
    ]
    assert FlowWindow.objects.count() == 0


def test_counts_beyond_any_host_are_refused_per_window_and_those_at_the_bound_land(db):
    """Four billion connections or 18 PB in one window: beyond any host, and what keeps a quarter
    day's sums of a key inside their 64-bit columns."""
    workload, _, _ = enrolled()
    data = at_agent_clock(golden(), clock.now())
    window = {**data["windows"][0], "accounting": True}
    group = window["groups"][0]

    def with_counts(**counts):
        return {**window, "id": str(uuid.uuid4()), "groups": [{**group, **counts}]}

    windows = [
        with_counts(connection_count=2**32),
        with_counts(bytes_in=2**54),
        with_counts(bytes_out=2**62),
        with_counts(connection_count=2**32 - 1, bytes_in=2**54 - 1, bytes_out=2**54 - 1),
    ]
    answer = flow_report_ingest(workload_id=str(workload.id), data={**data, "windows": windows, "gaps": []})
    assert [(r["result"], r["reason"]) for r in answer["windows"]] == [
        ("refused", "connection_count is a whole number from 0 to 4294967295"),
        ("refused", "bytes_in is a whole number from 0 to 18014398509481983"),
        ("refused", "bytes_out is a whole number from 0 to 18014398509481983"),
        ("accepted", None),
    ]
    assert FlowGroup.objects.get().connection_count == 2**32 - 1


def test_a_window_older_than_the_retention_or_years_ahead_is_refused_and_the_rest_lands(db):
    workload, _, _ = enrolled()
    runtime.facts_set(flow_retention_days=30)
    old = windows_between(clock.now() - timedelta(days=31), 1)
    ahead = windows_between(clock.now() + timedelta(days=400), 1)
    fine = windows_between(clock.now() - timedelta(minutes=10), 1)
    answer = flow_report_ingest(workload_id=str(workload.id), data=flow_report("p1", 100, old + ahead + fine))
    results = [(r["result"], r["reason"]) for r in answer["windows"]]
    assert results[2] == ("accepted", None)
    assert [r for r, _ in results[:2]] == ["refused", "refused"]
    assert all("outside the stored range" in reason for _, reason in results[:2])
    assert FlowWindow.objects.count() == 1


def _submitted(workload_id, data: dict):
    from flows.partitions import flow_partitions_ensure
    from flows.reports import report_parse
    from flows.services import SubmittedReport

    parsed = report_parse(data, now=clock.now())
    flow_partitions_ensure(days=parsed.days)
    return SubmittedReport(workload_id, parsed)


def _with_new_ids(data: dict) -> dict:
    import uuid

    return {
        **data,
        "windows": [{**w, "id": str(uuid.uuid4())} for w in data["windows"]],
        "gaps": [{**g, "id": str(uuid.uuid4())} for g in data["gaps"]],
    }


def test_reports_of_several_workloads_written_together_are_each_stored_and_answered(db):
    import uuid

    from flows.models import FlowHour
    from flows.services import flow_reports_write
    from flows.sums.writes import flow_windows_sum

    first, second, third = (enrolled(f"web-{i}", f"10.50.1.{i}")[0] for i in range(3))
    stored_before = at_agent_clock(golden(), clock.now())
    flow_report_ingest(workload_id=str(first.id), data=stored_before)
    nobody = uuid.uuid4()
    answers = flow_reports_write(
        [
            _submitted(first.id, stored_before),  # a re-send: acknowledged, not stored again
            _submitted(second.id, at_agent_clock(_with_new_ids(golden()), clock.now())),
            _submitted(nobody, at_agent_clock(_with_new_ids(golden()), clock.now())),
            _submitted(third.id, at_agent_clock(_with_new_ids(golden()), clock.now() + timedelta(hours=1))),
        ]
    )
    for answer in (answers[0], answers[1], answers[3]):
        assert [r["result"] for r in answer["windows"] + answer["gaps"]] == ["accepted", "accepted"]
    assert isinstance(answers[2], Problem) and answers[2].name == "not-found"
    assert (
        FlowWindow.objects.count() == 3
        and FlowGroup.objects.count() == 6
        and EvidenceGap.objects.count() == 3
    )
    assert not FlowHour.objects.exists()  # summed later, by serve's housekeeping
    assert flow_windows_sum(before=clock.now() + timedelta(days=3650)) == 3  # golden windows are in 2027
    for workload in (first, second, third):
        hours = FlowHour.objects.filter(workload=workload)
        assert sorted(hours.values_list("connection_count", flat=True)) == [1, 3]
        workload.refresh_from_db()
        assert workload.last_flow_report_at is not None and workload.last_gap_kind == "source_overrun"
    third.refresh_from_db()
    assert 3595 <= third.clock_skew_seconds <= 3605
    second.refresh_from_db()
    assert second.clock_skew_seconds is None


def test_a_write_runs_the_same_statements_for_one_report_as_for_several(db):
    """No statement per report or per row: a field the write reads but did not load, or an ORM save,
    would add one per workload. SQLite alone updates its workloads one statement each."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from flows.services import flow_reports_write

    workloads = [enrolled(f"web-{i}", f"10.50.2.{i}")[0] for i in range(5)]

    def statements(batch):
        reports = [_submitted(w.id, at_agent_clock(_with_new_ids(golden()), clock.now())) for w in batch]
        with CaptureQueriesContext(connection) as captured:
            flow_reports_write(reports)
        return len(captured.captured_queries)

    statements(workloads[:1])  # the first write after enrolments also reads the fleet's addresses
    one, three = statements(workloads[1:2]), statements(workloads[2:])
    assert three - one == (0 if connection.vendor == "postgresql" else 2)


@pytest.mark.postgres
def test_writers_in_several_serve_processes_store_a_window_once(transactional_db):
    """The in-process group commit keeps one workload's reports apart; across serve processes the
    workload's row lock does: four writers, each on its own connection, as four processes would be."""
    from django.db import connection

    from flows.services import flow_reports_write
    from tests.support.requirements import require

    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    workload, _, _ = enrolled()
    item = _submitted(workload.id, at_agent_clock(golden(), clock.now()))
    results = race(*[lambda: flow_reports_write([item]) for _ in range(4)])
    assert not [r for r in results if isinstance(r, Exception) or isinstance(r[0], Exception)], results
    assert all(r[0]["windows"][0]["result"] == "accepted" for r in results)
    assert (
        FlowWindow.objects.count() == 1
        and FlowGroup.objects.count() == 2
        and EvidenceGap.objects.count() == 1
    )


@pytest.mark.postgres
def test_a_batch_skips_a_workload_another_transaction_holds_and_writes_its_report_after(transactional_db):
    """A batch never waits for a row while holding others (a cycle with a re-render that locks the
    same rows in another order would be a deadlock): the held workload's report is written alone,
    once its row is free, and the rest of the batch is stored meanwhile."""
    import threading

    from django.db import connection, transaction

    from fleet.models import Workload
    from flows.services import flow_reports_write
    from tests.support.requirements import require

    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    held, free = enrolled("held", "10.50.2.1")[0], enrolled("free", "10.50.2.2")[0]
    items = [
        _submitted(held.id, at_agent_clock(_with_new_ids(golden()), clock.now())),
        _submitted(free.id, at_agent_clock(_with_new_ids(golden()), clock.now())),
    ]
    locked, release, answers = threading.Event(), threading.Event(), []

    def holder():
        try:
            with transaction.atomic():
                list(Workload.objects.select_for_update().filter(id=held.id))
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    def writer():
        try:
            answers.extend(flow_reports_write(items))
        finally:
            connection.close()

    threads = [threading.Thread(target=holder), threading.Thread(target=writer)]
    threads[0].start()
    assert locked.wait(10)
    threads[1].start()

    def stored(workload) -> int:
        return FlowWindow.objects.filter(workload=workload).count()

    deadline = time.monotonic() + 10
    while stored(free) == 0:
        assert time.monotonic() < deadline, "the batch waited for the held workload"
        time.sleep(0.02)
    assert stored(held) == 0 and not answers  # the held one waits for its row, alone
    release.set()
    for thread in threads:
        thread.join(10)
    assert [a["windows"][0]["result"] for a in answers] == ["accepted", "accepted"]
    assert stored(held) == 1 and stored(free) == 1


def test_a_credential_changed_after_the_headers_passed_refuses_the_report_when_it_is_written(db, clock_at):
    """The gateway checks a report's sender before its body (or takes the body gate's pass of its
    headers); the write judges that sender again under its workload's lock, so a revocation, renewal or
    expiry that came in between refuses the report whole, and nothing of it is stored."""
    from controlplane.auth.actor import CLI_ACTOR
    from fleet.credentials import credential_revoke
    from fleet.models import Workload

    workload, _, credential = enrolled()
    sender = report_sender_authenticate(workload_id=str(workload.id), credential=credential)
    report = at_agent_clock(golden(), clock.now())
    renewed = Workload.objects.get(id=workload.id)
    Workload.objects.filter(id=workload.id).update(credential_serial=renewed.credential_serial + 1)
    with pytest.raises(Problem, match="enrolled workload") as refused:
        flow_report_ingest(workload_id=str(workload.id), data=report, sender=sender)
    assert refused.value.name == "unauthenticated"
    Workload.objects.filter(id=workload.id).update(credential_serial=renewed.credential_serial)
    credential_revoke(actor=CLI_ACTOR, workload_id=str(workload.id))
    with pytest.raises(Problem) as refused:
        flow_report_ingest(workload_id=str(workload.id), data=report, sender=sender)
    assert refused.value.name == "credential-revoked"
    assert FlowWindow.objects.count() == 0 and EvidenceGap.objects.count() == 0

    other, _, other_credential = enrolled(hostname="db", address="10.50.0.2")
    sender = report_sender_authenticate(workload_id=str(other.id), credential=other_credential)
    clock_at(other.credential_expires_at - clock.now() + timedelta(seconds=1))
    with pytest.raises(Problem, match="renew it on the sync stream"):
        flow_report_ingest(
            workload_id=str(other.id), data=at_agent_clock(golden(), clock.now()), sender=sender
        )
    clock_at(-timedelta(seconds=2))  # before the expiry again: the same sender's report is stored
    answer = flow_report_ingest(
        workload_id=str(other.id), data=at_agent_clock(golden(), clock.now()), sender=sender
    )
    assert [r["result"] for r in answer["windows"]] == ["accepted"]


@pytest.mark.postgres
def test_a_write_whose_lock_times_out_stores_nothing_and_the_next_one_lands(transactional_db):
    """The lock of a row another transaction holds, past the session's lock timeout, raises Django's
    error from the write, nothing of it is stored, and the same connection writes the report once the
    row is free (its transaction was rolled back, the connection left as Django expects it). It held
    the write that sent its statements together (branch ingest5, c0a93b7 and f605c5f, not kept)."""
    import threading

    from django.db import OperationalError, connection, transaction

    from fleet.models import Workload
    from flows.services import flow_reports_write
    from tests.support.requirements import require

    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    workload = enrolled("held", "10.50.4.1")[0]
    item = _submitted(workload.id, at_agent_clock({**_with_new_ids(golden()), "gaps": []}, clock.now()))
    locked, release = threading.Event(), threading.Event()

    def holder():
        try:
            with transaction.atomic():
                list(Workload.objects.select_for_update().filter(id=workload.id))
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert locked.wait(10)
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '100ms'")
        with pytest.raises(OperationalError, match="lock"):
            flow_reports_write([item])
        assert not connection.in_atomic_block and connection.get_autocommit()
        assert FlowWindow.objects.filter(workload=workload).count() == 0
    finally:
        release.set()
        thread.join(10)
    answers = flow_reports_write([item])
    assert answers[0]["windows"][0]["result"] == "accepted"
    assert FlowWindow.objects.filter(workload=workload).count() == 1
    assert FlowGroup.objects.filter(workload=workload).count() == 2

"""Every field of a flow report, and every query parameter of the flow endpoints, given values of every
JSON type and odd text: each is refused with a reason or a problem document, never an exception or a 5xx.
Runs on SQLite and PostgreSQL (CI)."""

from __future__ import annotations

import copy
import itertools
import uuid
from datetime import timedelta
from typing import Any

from controlplane import clock
from controlplane.problems import Problem, ValidationFailed
from flows.models import EvidenceGap, FlowWindow
from flows.services import flow_report_ingest
from tests.support.flow_evidence import enrolled, flow_report, windows_between
from tests.support.helpers import run_command
from tests.support.hostile_text import HOSTILE, HOSTILE_TEXT, assert_shown_harmlessly, unsafe_in

JSON_VALUES = [None, True, False, 0, -1, 1.5, 2**70, -(2**70), "", "x", "x" * 500, [], {}, [1], {"a": 1},
               "2026-01-01T00:00:00Z", "9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00",
               "::ffff:10.0.0.1", "fe80::1%eth0", "255", "256", "6"]  # fmt: skip

QUERY_VALUES = [
    "",
    " ",
    "0",
    "-1",
    "99999999999999999999999999",
    "1e9",
    "NaN",
    "x" * 5000,
    "\x00",
    "ü",
    "../",
    "null",
    "2026-13-01T00:00:00Z",
    "2026-01-01",
    "2026-01-01T00:00:00",
    "9999-12-31T23:59:59Z",
    "0001-01-01T00:00:00Z",
    "00000000-0000-0000-0000-000000000000",
    "tcp/",
    "tcp/99999",
    "/80",
    "::1%eth0",
    "10.0.0.0/8",
    "a=b",
    "a=",
    "=b",
    "a!=b",
    "a in (b)",
    "rule",
    "start",
    "id",
    "²",
    "tcp/²",
    "٣",
    "tcp/٣",
]  # fmt: skip  (str.isdigit admits these; int takes only some)
ENCODED_VALUES = ["%ED%A0%80", "%FF", "%00", "%C0%AF"]  # a surrogate, bytes that are not UTF-8, NUL
ENDPOINTS = {
    "/api/v1/flows": ["workload", "from", "to", "cursor", "limit", "decision", "peer", "service", "rule"],
    "/api/v1/flows/rollup": ["workload", "label", "from", "to", "group_by", "cursor", "limit"],
    "/api/v1/flows/gaps": ["workload", "label", "from", "to", "cursor", "limit"],
    "/api/v1/flows/review": ["workload", "label", "from", "to"],
}


def _base_report() -> dict:
    report = flow_report("p1", 100, windows_between(clock.now() - timedelta(minutes=10), 1))
    window = report["windows"][0]
    report["gaps"] = [{"id": str(uuid.uuid4()), "kind": "window_overflow", "source": None,
                       "start": window["start"], "end": window["end"], "lost": {"keys": 1}}]  # fmt: skip
    return report


def _variants(base: dict):
    """The report with one field at a time set to each value (fresh ids, so nothing is a re-send)."""
    window, gap = base["windows"][0], base["gaps"][0]
    places = [(lambda r: r, base), (lambda r: r["windows"][0], window),
              (lambda r: r["windows"][0]["groups"][0], window["groups"][0]), (lambda r: r["gaps"][0], gap)]  # fmt: skip
    for (part_of, part), value in itertools.product(places, JSON_VALUES):
        for name in part:
            report = copy.deepcopy(base)
            report["windows"][0]["id"], report["gaps"][0]["id"] = str(uuid.uuid4()), str(uuid.uuid4())
            # Another agent process each time, so the envelope's uptime reaches the agent_silent rules.
            report["process_start_id"] = f"p-{uuid.uuid4().hex[:8]}"
            part_of(report)[name] = value
            yield name, value, report


def test_every_field_of_a_report_at_every_json_type_is_refused_or_stored_never_an_exception(db):
    workload, _, _ = enrolled("odd", "10.50.0.9")
    failures = []
    for name, value, report in _variants(_base_report()):
        try:
            flow_report_ingest(workload_id=str(workload.id), data=report)
        except (Problem, ValidationFailed):
            pass
        except Exception as error:  # noqa: BLE001 - collected, so that one run lists every case
            failures.append(f"{name}={value!r:.40}: {error!r:.200}")
    assert not failures, "\n".join(failures)


def test_every_query_parameter_of_the_flow_endpoints_answers_odd_values_without_a_5xx(api, db):
    workload, _, _ = enrolled("odd", "10.50.0.9")
    flow_report_ingest(workload_id=str(workload.id), data=_base_report())
    now = clock.now()
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    base = {"from": text(now - timedelta(hours=1)), "to": text(now + timedelta(hours=1)),
            "workload": str(workload.id), "group_by": "peer"}  # fmt: skip
    failures = []
    for path, params in ENDPOINTS.items():
        for param in params:
            rest = "&".join(f"{k}={v}" for k, v in base.items() if k != param)
            answers = [(value, api.get(path, {**base, param: value})) for value in QUERY_VALUES]
            answers += [(value, api.get(f"{path}?{param}={value}&{rest}")) for value in ENCODED_VALUES]
            answers.append(("twice", api.get(f"{path}?{param}=a&{param}=b&{rest}")))
            failures += [
                f"{path} {param}={value!r:.40}: {response.status_code}"
                for value, response in answers
                if response.status_code not in (200, 404, 422)
            ]
    assert not failures, "\n".join(failures)


def test_ranges_at_the_ends_of_the_calendar_are_refused_not_an_overflow(api, db):
    workload, _, _ = enrolled("odd", "10.50.0.9")
    flow_report_ingest(workload_id=str(workload.id), data=_base_report())  # a window length to reach back
    ranges = [("0001-01-01T00:00:00Z", "0001-01-02T00:00:00Z"), ("0001-01-01T00:00:30Z", "0001-01-01T01:00:00Z"),
              ("9999-12-31T00:00:00Z", "9999-12-31T23:59:59.999999Z"), ("1969-12-31T23:00:00Z", "1970-01-01T01:00:00Z")]  # fmt: skip
    for path in ENDPOINTS:
        for start, end in ranges:
            params = {"from": start, "to": end, "workload": str(workload.id), "group_by": "peer"}
            response = api.get(path, params)
            assert response.status_code == 422, (path, start, end, response.status_code)
            assert {e["path"] for e in response.json()["errors"]} & {"?from", "?to"}


def test_instants_in_iso_8601_forms_that_are_not_rfc_3339_are_refused_not_guessed(api, db):
    """Python's fromisoformat reads ISO 8601's other forms too; the contract says RFC 3339, so a
    script that sends one of them learns it instead of getting a range it did not mean."""
    workload, _, _ = enrolled("odd", "10.50.0.9")
    end = "2026-11-27T02:00:00Z"
    not_rfc_3339 = ["20261127T010000+0000", "2026-W48-5T01:00:00+00:00", "2026-11-27T01+00:00",
                    "2026-11-27T01:00+00:00", "2026-11-27T01:00:00.Z", "2026-11-27T01:00:00 Z",
                    "2026-11-27T01:00:00,5Z", "2026-11-27T01:00:00+0000", "2026-11-27T01:00:00Z\x00",
                    "2026-11-27 01:00:00Z", "２026-11-27T01:00:00Z"]  # fmt: skip
    for path in ENDPOINTS:
        for start in not_rfc_3339:
            params = {"from": start, "to": end, "workload": str(workload.id), "group_by": "peer"}
            response = api.get(path, params)
            assert response.status_code == 422, (path, start, response.status_code)
            assert [(e["path"], e["rule"]) for e in response.json()["errors"]] == [("?from", "instant")]
        for start in ("2026-11-27T01:00:00Z", "2026-11-27t01:00:00.25z", "2026-11-27T02:00:00.5+01:00"):
            params = {"from": start, "to": end, "workload": str(workload.id), "group_by": "peer"}
            assert api.get(path, params).status_code == 200, (path, start)


def test_an_agents_control_characters_are_stored_escaped_and_every_output_shows_them_harmlessly(api, db):
    """ESC sequences, BEL, CR, NUL, C1 and bidi overrides in a gap's `lost` names and a window's
    policy_version are stored escaped (`\\x1b`, `\\u202e`), the evidence kept; every read shows them so."""
    workload, _, _ = enrolled("odd", "10.50.0.9")
    report = _base_report()
    report["windows"][0]["policy_version"] = HOSTILE_TEXT[:80]
    report["gaps"][0]["lost"] = dict.fromkeys(HOSTILE[:8], 1)
    report["gaps"].append(
        {**report["gaps"][0], "id": str(uuid.uuid4()), "lost": dict.fromkeys(HOSTILE[8:], 2)}
    )
    answer = flow_report_ingest(workload_id=str(workload.id), data=report)
    assert [r["result"] for r in answer["windows"] + answer["gaps"]] == ["accepted"] * 3
    stored = {name for gap in EvidenceGap.objects.all() for name in gap.lost}
    assert len(stored) == len(HOSTILE) and "\\x1b[2J\\x1b[H" in stored and "\\u202eevil" in stored
    assert not unsafe_in("".join(stored) + FlowWindow.objects.get().policy_version)

    window = report["windows"][0]
    body = api.get(
        "/api/v1/flows/gaps", {"workload": str(workload.id), "from": window["start"], "to": window["end"]}
    )
    assert_shown_harmlessly(body.content.decode())  # stored escaped: the API shows them so too

    # Text stored raw before ingestion escaped it is shown harmlessly all the same (PostgreSQL's jsonb
    # holds no NUL and no lone surrogate: such a name was a database error, a 500, before).
    storable = [text for text in HOSTILE if "\x00" not in text and "\ud800" not in text]
    EvidenceGap.objects.filter(lost__has_key="\\u202eevil").update(lost=dict.fromkeys(storable, 3))
    span = ["--from", report["windows"][0]["start"], "--to", report["windows"][0]["end"]]
    where = ["--workload", str(workload.id)]
    for command in (["gaps", *where], ["list", "--workload", str(workload.id)], ["rollup", "--group-by", "peer", *where],
                    ["review", *where]):  # fmt: skip
        for output in ([], ["--json"], ["--csv"]) if command[0] != "review" else ([], ["--json"]):
            code, out, err = run_command("flows", *command, *span, *output)
            assert code in (0, 3), err
            assert_shown_harmlessly(out + err)
    code, out, _ = run_command("flows", "gaps", *where, *span)
    assert "\\x1b[2J\\x1b[H=3" in out and "two\\x0alines\\x09x=3" in out  # escaped, a line each gap


def test_a_process_start_id_with_control_characters_refuses_the_report(db):
    workload, _, _ = enrolled("odd", "10.50.0.9")
    for process in ("p\x1b[2J", "p\u202e", "p\n"):
        try:
            flow_report_ingest(
                workload_id=str(workload.id), data={**_base_report(), "process_start_id": process}
            )
        except ValidationFailed as refused:
            assert [f.rule for f in refused.findings] == ["control-characters"]
        else:
            raise AssertionError(f"{process!r} was taken")


GROUP_VALUES = [*JSON_VALUES, 65535, 65536, 2**24 - 1, 2**24, 2**32 - 1, 2**32, 2**54 - 1, 2**54, "tcp", "udp",
                "icmpv6", "*", "allowed", "blocked", "would_block", "inbound", "outbound", "10.0.0.1",
                "::ffff:10.0.0.1", "2001:db8::1", "", "x" * 65, "2026-11-29T02:00:30.000000Z",
                "2026-11-29T02:00:30.000000z", "2026-11-29 02:00:30.000000Z", "2026-11-29T02:00:30.00000\u0663Z",
                "2026-13-29T02:00:30.000000Z", "2026-11-29T02:00:30.000000+00:00", "2026-11-29T02:02:00.000000Z"]  # fmt: skip


def test_a_plain_key_takes_the_short_way_and_is_stored_or_refused_as_the_checked_way_does() -> None:
    """`_group`'s one-pass way for plain keys accepts only what `_group_checked` accepts, and stores
    the same: every field of a key at every value, absent too, with and without accounting."""
    from datetime import UTC, datetime

    from flows.reports import Refused, _group, _group_checked

    start = datetime(2026, 11, 29, 2, 0, tzinfo=UTC)
    end = start + timedelta(minutes=1)
    base = {"peer": "10.0.0.1", "protocol": "tcp", "port": 443, "decision": "allowed", "rule": None,
            "direction": "inbound", "failsafe": False, "connection_count": 3,
            "first_seen": "2026-11-29T02:00:01.000000Z", "last_seen": "2026-11-29T02:00:59.500000Z",
            "bytes_in": 0, "bytes_out": 0}  # fmt: skip

    def outcome(way: Any, raw: Any, accounting: bool) -> Any:
        try:
            return way(raw, start=start, end=end, accounting=accounting)
        except Refused as refused:
            return ("refused", str(refused), refused.code)

    cases: list[Any] = [
        None,
        [],
        "x",
        {},
        dict(base),
        {**base, "rule": 7, "bytes_in": 5},
        {**base, "peer": "*", "protocol": "*", "port": 0},
    ]
    for name, value in itertools.product(base, [*GROUP_VALUES, "absent"]):
        case = dict(base)
        if value == "absent":
            del case[name]
        else:
            case[name] = value
        cases.append(case)
    stored = 0
    for case, accounting in itertools.product(cases, (False, True)):
        short, checked = outcome(_group, case, accounting), outcome(_group_checked, case, accounting)
        assert short == checked, case
        assert type(short) is tuple or {k: type(v) for k, v in short.items()} == {
            k: type(v) for k, v in checked.items()
        }
        stored += type(short) is dict
    assert stored > 50  # the cases reach both ways

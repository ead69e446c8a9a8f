"""One definition of the flow report: the agent's (agent/protocol.py) is what the gateway checks against
(flows/reports.py), and the agent never sends more than the gateway accepts. The golden file
(tests/golden/flows/flow_report.json, tests/flows/test_ingestion.py) pins the bytes."""

from __future__ import annotations

import dataclasses
import json

import pytest
from django.conf import settings
from django.test import RequestFactory

from agent import flowreporter, protocol
from controlplane.gateway_views import gateway_info
from controlplane.problems import ValidationFailed
from flows import reports
from flows.choices import AGGREGATE, GapKind


def _report(**change) -> dict:
    body = protocol.flow_report(
        agent_clock="2027-01-15T08:01:01.000000Z",
        process_start_id="p",
        uptime_seconds=1.0,
        window_seconds=60,
        windows=[],
        gaps=[],
    )
    return {**body, **change}


def test_the_gateway_reads_a_report_by_the_agents_definition_of_it():
    assert tuple(f.name for f in dataclasses.fields(reports.Report)) == protocol.FLOW_REPORT_FIELDS
    assert reports.report_envelope(_report()).process_start_id == "p"
    for change, path in (
        ({"v": protocol.PROTOCOL_VERSION + 1}, "/type"),
        ({"type": "heartbeat"}, "/type"),
        ({"extra": 1}, "/extra"),
    ):
        with pytest.raises(ValidationFailed) as refused:
            reports.report_envelope(_report(**change))
        assert [finding.path for finding in refused.value.findings] == [path]
    assert refused.value.findings[0].message == "Not a field of a flow report."
    with pytest.raises(ValidationFailed) as refused:
        reports.report_envelope(_report(type="heartbeat"))
    assert refused.value.findings[0].message == "Expected a flow_report of agent protocol 1."


def test_the_agent_sends_no_more_than_the_gateway_accepts():
    assert flowreporter.BATCH_MAX_WINDOWS <= reports.ACCEPTED_MAX_WINDOWS
    assert flowreporter.BATCH_MAX_GAPS <= reports.ACCEPTED_MAX_GAPS
    assert flowreporter.REPORT_BUDGET_BYTES <= settings.PALISADE_MAX_FLOW_REPORT_BYTES


def test_the_agent_bounds_keys_as_the_control_plane_does_so_that_it_sums_none_of_them_again():
    """The agent counts as many keys one by one per window as the control plane keeps, sends no more
    keys in a report than it keeps per report, and sums the rest into the same aggregate key with the
    same gap kind (a plain copy: the agent imports nothing of the control plane)."""
    from agent import flowwindow

    assert flowreporter.DEFAULT_WINDOW_KEYS == settings.PALISADE_FLOW_WINDOW_MAX_KEYS
    assert flowreporter.BATCH_MAX_KEYS == settings.PALISADE_FLOW_REPORT_MAX_KEYS
    assert flowwindow.AGGREGATE == AGGREGATE and flowwindow.KEYS_AGGREGATED == GapKind.KEYS_AGGREGATED


def test_the_gateway_says_it_speaks_the_agents_protocol_version():
    answer = json.loads(gateway_info(RequestFactory().get("/agent/v1/info")).content)
    assert answer["service"] == "palisade-gateway" and answer["protocol"] == protocol.PROTOCOL_VERSION

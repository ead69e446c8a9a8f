"""Retry-After, as the agent reads it from a gateway's 503 (its database away) or 429: flow reports
wait that long, not their own backoff. Enrolment: tests/agent/test_enrol.py; the real gateway's 503s:
tests/e2e/test_database_outage_on_serve.py."""

from __future__ import annotations

from email.utils import formatdate

from agent.flowreporter import FlowReporter, FlowSettings
from agent.protocol import MAX_RETRY_AFTER_SECONDS, close_reason_retry_after, retry_after
from agent.state import StateDir


def test_seconds_or_an_http_date_on_503_and_429_only():
    assert retry_after(503, "7") == 7.0 and retry_after(429, " 1 ") == 1.0
    assert retry_after(503, formatdate(1_000_030, usegmt=True), now=1_000_000) == 30.0
    assert retry_after(503, formatdate(999_000, usegmt=True), now=1_000_000) == 0.0  # already past
    assert retry_after(503, "99999999") == MAX_RETRY_AFTER_SECONDS
    assert retry_after(500, "7") is None and retry_after(401, "7") is None
    assert (
        retry_after(503, None) is None and retry_after(503, "soon") is None and retry_after(503, "-3") is None
    )


def test_a_4503_close_reason_may_say_when_to_come_back():
    assert close_reason_retry_after("database unavailable: retry after 9 s") == 9.0
    assert close_reason_retry_after("control plane shutting down") is None
    assert close_reason_retry_after("") is None


def test_a_flow_report_refused_with_retry_after_waits_that_long_then_backs_off_as_before(tmp_path):
    state = StateDir(tmp_path)
    state.create()
    reporter = FlowReporter(
        state, settings=FlowSettings(), context=lambda: None, policy_version=lambda: "v",  # type: ignore[arg-type, return-value]
        table_absent=lambda: False, process_start_id="p", log=lambda *a, **k: None, sources={},
        accounting=False,
    )  # fmt: skip
    reporter.attempt = 2  # its own backoff at most 4 s: the Retry-After is the longer wait
    reporter.retry_after = 12.0
    assert 12.0 <= reporter.delay_after_failure() <= 24.0  # no sooner, spread over as long again
    assert reporter.retry_after is None and 0 <= reporter.delay_after_failure() <= 60

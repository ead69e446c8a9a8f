"""Retry-After, as the agent reads it from a gateway's 503 (its database away) or 429: flow reports
wait that long, spread over as long again, unless their own backoff is the longer wait. Enrolment:
tests/agent/test_enrol.py; the real gateway's 503s: tests/e2e/test_database_outage_on_serve.py."""

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
    reporter.attempt = 3  # its backoff, at most 8 s, is the shorter wait
    reporter.retry_after = 12.0
    assert 12.0 <= reporter.delay_after_failure() <= 24.0  # no sooner, spread over as long again
    assert reporter.retry_after is None and 0 <= reporter.delay_after_failure() <= 60


def test_a_long_outage_leaves_the_flow_reports_backoff_at_its_cap(tmp_path):
    """After a thousand failed reports (some eight hours of a gateway away), the doubling overflowed a
    float and ended the reporting loop."""
    state = StateDir(tmp_path)
    state.create()
    reporter = FlowReporter(
        state, settings=FlowSettings(), context=lambda: None, policy_version=lambda: "v",  # type: ignore[arg-type, return-value]
        table_absent=lambda: False, process_start_id="p", log=lambda *a, **k: None, sources={},
        accounting=False,
    )  # fmt: skip
    reporter.attempt = 1100
    assert all(0 <= reporter.delay_after_failure() <= 60 for _ in range(20))


def test_the_stream_and_the_reports_back_off_by_one_rule():
    from agent import daemon, flowreporter
    from agent.backoff import retry_delay

    assert daemon.retry_delay is flowreporter.retry_delay is retry_delay
    # The stream waits what the gateway asked for (it draws that at random per answer); a report
    # spreads it over as long again.
    assert retry_delay(3, 9.0, spread=False) == 9.0 and retry_delay(3, 0.0, spread=False) == 0.0
    assert all(9.0 <= retry_delay(0, 9.0) <= 18.0 for _ in range(100))
    assert all(0 <= retry_delay(3, None, spread=False) <= 8 for _ in range(100))


def test_a_busy_gateway_caps_the_backoff_at_15_s():
    from agent.backoff import BUSY_CAP, retry_delay

    assert BUSY_CAP == 15.0
    assert all(0 <= retry_delay(30, None, spread=False, cap=BUSY_CAP) <= 15 for _ in range(200))
    assert max(retry_delay(30, None, spread=False) for _ in range(200)) > 15  # the usual cap is 60

"""What serve decides about a body before it receives it (controlplane/body_gate.py); on the real serve
in tests/e2e/test_gateway_bodies.py."""

from __future__ import annotations

from agent.protocol import ENROL_PATH, FLOWS_PATH
from controlplane.body_gate import BodyBudget, _request_path, view_for
from controlplane.listeners import GATEWAY, OPERATOR
from flows.gateway import report_sender_of


def test_a_budget_admits_what_fits_and_a_body_larger_than_itself_only_alone():
    budget = BodyBudget(10)
    assert budget.take(6) and budget.take(4)
    assert not budget.take(1)
    budget.give_back(4)
    assert not budget.take(5) and budget.take(4)
    budget.give_back(10)
    assert budget.take(25)  # nothing else in flight
    assert not budget.take(1)
    budget.give_back(25)
    assert budget.in_flight == 0


def test_flow_reports_on_the_gateway_are_the_bodies_checked_by_their_headers_first():
    def check(listener: str, path: str):
        return getattr(view_for(listener, path), "headers_check", None)

    assert check(GATEWAY, FLOWS_PATH) is report_sender_of
    assert check(GATEWAY, _request_path(b"/agent/v1/%66lows?x=1")) is report_sender_of  # as daphne routes it
    assert check(OPERATOR, FLOWS_PATH) is None  # not served there
    assert check(GATEWAY, ENROL_PATH) is None  # enrolment carries its token in the body
    assert check(GATEWAY, "/nowhere") is None
    assert _request_path(b"/\xff") == ""


def test_headers_a_check_passed_pass_again_for_a_while_by_the_views_key_only():
    from controlplane.body_gate import PassedHeaders
    from flows.gateway import FlowReportView

    assert view_for(GATEWAY, FLOWS_PATH) is FlowReportView
    headers = {"Palisade-Workload": "w1", "Palisade-Credential": "c1", "Palisade-Signature": "s1"}
    key = PassedHeaders.key(FLOWS_PATH, FlowReportView, headers)
    assert key == PassedHeaders.key(FLOWS_PATH, FlowReportView, {**headers, "Palisade-Signature": "s2"})
    assert key != PassedHeaders.key(FLOWS_PATH, FlowReportView, {**headers, "Palisade-Credential": "c2"})
    assert key != PassedHeaders.key(FLOWS_PATH, FlowReportView, {**headers, "Palisade-Workload": "w2"})
    assert PassedHeaders.key(FLOWS_PATH, None, headers) is None  # a view without a key is always checked

    passed = PassedHeaders(seconds=60, most=2)
    assert not passed.passed(key) and not passed.passed(None)
    passed.remember(key)
    passed.remember(None)
    assert passed.passed(key)
    passed.remember(b"a")
    passed.remember(b"b")  # over `most`: what is remembered is forgotten, never unbounded
    assert len(passed.until) <= 2
    stale = PassedHeaders(seconds=-1)
    stale.remember(key)
    assert not stale.passed(key)

    # What the check returned (a report's sender) is the view's while the pass holds, and only then.
    trusted = [True]
    passed = PassedHeaders(seconds=60, trusted=lambda: trusted[0])
    passed.remember(key, "w1", value="sender")
    assert passed.passed_value(key) == "sender" and passed.passed_value(b"other") is None
    trusted[0] = False
    assert passed.passed_value(key) is None
    trusted[0] = True
    passed.forget("w1")
    assert passed.passed_value(key) is None
    stale.remember(key, value="sender")
    assert stale.passed_value(key) is None


def test_bodies_over_the_small_size_leave_a_reserve_to_the_small_ones():
    budget = BodyBudget(64, reserve=16, small=1)
    assert budget.take(30) and budget.take(18)  # 48: what bodies over 1 may take
    assert not budget.take(2)
    assert budget.take(1)  # a small one takes the reserve
    # A chunked body is small until its bytes so far pass the size.
    assert budget.take(1, body=1)
    assert not budget.take(1, body=2)
    budget.give_back(50)
    assert budget.in_flight == 0 and budget.take(100)  # larger than the budget: admitted alone
    assert not budget.take(1)


def test_the_gateways_bodies_that_are_not_reports_have_a_small_budget_of_their_own():
    from django.conf import settings

    from controlplane.body_gate import LOGIN, OTHER, OTHER_BODY_BYTES, _route

    assert _route(GATEWAY, FLOWS_PATH)[:2] == (GATEWAY, settings.PALISADE_MAX_FLOW_REPORT_BYTES)
    assert _route(GATEWAY, ENROL_PATH)[::3] == (OTHER, None)  # nobody's credential to check first
    assert _route(GATEWAY, ENROL_PATH)[1] == OTHER_BODY_BYTES == 64 * 1024
    assert _route(GATEWAY, "/nowhere")[0] == OTHER
    assert _route(OPERATOR, "/api/v1/session")[0] == LOGIN
    assert _route(OPERATOR, "/api/v1/services")[0] == OPERATOR

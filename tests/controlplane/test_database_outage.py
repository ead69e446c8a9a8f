"""The database away, in-process: what is recognised as unavailability, the log throttle, and the 503
problem (or console page) that requests get instead of a 500 and a traceback. The whole story under a
real serve and a real PostgreSQL stopped and started is tests/e2e/test_database_outage_on_serve.py."""

from __future__ import annotations

import logging
import sqlite3
import uuid

import psycopg
import pytest
from django.db import IntegrityError, OperationalError, connection
from django.test import Client

from controlplane.outage import SETTLE_SECONDS, OutageLog, database_unavailable
from tests.support.helpers import assert_problem
from tests.support.serve_process import free_port


@pytest.fixture
def database_away(transactional_db):
    """Every new connection fails as it does with the server stopped (PostgreSQL: refused on a closed
    port; SQLite: a file that cannot be opened). The open connection is put aside, not closed: the
    test database (in memory, on SQLite) must still be there afterwards."""
    saved = dict(connection.settings_dict)
    kept = connection.connection

    def away():
        connection.connection = None
        if connection.vendor == "postgresql":
            connection.settings_dict.update(HOST="127.0.0.1", PORT=str(free_port()))
        else:
            connection.settings_dict["NAME"] = "/nonexistent-palisade-dir/palisade.sqlite3"

    away()
    yield
    connection.settings_dict.clear()
    connection.settings_dict.update(saved)
    connection.connection = kept


def _refused_connection() -> psycopg.OperationalError:
    try:
        psycopg.connect(f"postgresql://postgres@127.0.0.1:{free_port()}/x", connect_timeout=5)
    except psycopg.OperationalError as error:
        return error
    raise AssertionError("a closed port accepted a connection")


def _wrapped(error: BaseException) -> OperationalError:
    """As Django raises it: its own class, the driver's error as the cause."""
    try:
        raise OperationalError(str(error)) from error
    except OperationalError as wrapped:
        return wrapped


def test_what_counts_as_the_database_being_away():
    refused = _refused_connection()
    assert database_unavailable(refused) and database_unavailable(_wrapped(refused))
    assert database_unavailable(psycopg.errors.AdminShutdown("terminating connection"))
    assert database_unavailable(psycopg.errors.CannotConnectNow("the database system is starting up"))
    try:
        sqlite3.connect("file:/nonexistent-palisade-dir/x.sqlite3?mode=rw", uri=True)
    except sqlite3.OperationalError as error:
        assert database_unavailable(_wrapped(error))
    # A statement's own failure is a fault to see, not an outage.
    assert not database_unavailable(psycopg.errors.DeadlockDetected("deadlock detected"))
    assert not database_unavailable(psycopg.errors.QueryCanceled("statement timeout"))
    assert not database_unavailable(_wrapped(sqlite3.OperationalError("database is locked")))
    assert not database_unavailable(IntegrityError("duplicate key"))
    assert not database_unavailable(ValueError("no"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_kind_per_interval_with_a_count_and_back_once(caplog):
    clock = Clock()
    outage = OutageLog(every=30, clock=clock)
    error = _refused_connection()
    requests, streams = logging.getLogger("t.requests"), logging.getLogger("t.streams")
    with caplog.at_level(logging.INFO):
        for _ in range(500):
            outage.failed("answer requests", error, requests)
            outage.failed("serve agent streams", error, streams)
            clock.now += 0.05  # 25 s in all
        assert [r.getMessage().split(":")[:2] for r in caplog.records] == [
            ["database unavailable", " cannot answer requests"],
            ["database unavailable", " cannot serve agent streams"],
        ]
        clock.now += 5.1
        outage.failed("answer requests", error, requests)
        assert "(499 more since the last line, 30 s ago)" in caplog.records[-1].getMessage()
        caplog.clear()
        outage.available()
        outage.available()
        outage.failed("answer requests", error, requests)  # a request that was already on its way
        assert [r.getMessage() for r in caplog.records] == [
            "database available again after 30 s (1001 failures)"
        ]
        clock.now += SETTLE_SECONDS
        outage.failed("answer requests", error, requests)  # a new outage says so at once
        assert caplog.records[-1].getMessage().startswith("database unavailable: cannot answer requests")
        assert outage.down


def test_api_requests_get_a_503_problem_with_retry_after_and_no_traceback(token, database_away, caplog):
    from rest_framework.test import APIClient

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    with caplog.at_level(logging.INFO):
        for _ in range(20):
            response = api.get("/api/v1/workloads")
            body = assert_problem(response, 503, "service-unavailable")
            assert 5 <= int(response["Retry-After"]) <= 15 and body["retry_after"] == int(
                response["Retry-After"]
            )
        refused_enrolment = Client().post(
            "/agent/v1/enrol", {"v": 1, "token": "x"}, content_type="application/json",
            **{"palisade.listener": "gateway"},
        )  # fmt: skip
    assert_problem(refused_enrolment, 503, "service-unavailable")
    assert not any(r.exc_info for r in caplog.records)
    assert not [r for r in caplog.records if r.name in ("django.request", "palisade.access")]
    unavailable = [r for r in caplog.records if "database unavailable" in r.getMessage()]
    assert len(unavailable) <= 1, [r.getMessage() for r in unavailable]


def test_headers_checked_before_a_body_without_the_database_are_a_503_not_a_traceback(database_away, caplog):
    """serve checks a flow report's headers (and an operator's credential) before it receives the body
    (controlplane/body_gate.py): without the database that is the 503 the view would answer."""
    from django.utils.datastructures import CaseInsensitiveMapping

    from controlplane.auth.authentication import operator_credential_check
    from controlplane.auth.secrets import OPERATOR_TOKEN_PREFIX
    from controlplane.body_gate import headers_refusal
    from flows.gateway import report_sender_of

    report = {"Palisade-Workload": str(uuid.uuid4()), "Palisade-Credential": "c", "Palisade-Signature": "s"}
    with caplog.at_level(logging.INFO):
        for check, headers in (
            (report_sender_of, report),
            (operator_credential_check, {"Authorization": f"Bearer {OPERATOR_TOKEN_PREFIX}x"}),
        ):
            refusal, _ = headers_refusal(check, CaseInsensitiveMapping(headers))
            assert refusal is not None and refusal.name == "service-unavailable", refusal
            assert 5 <= int(refusal.headers["Retry-After"]) <= 15 and refusal.status == 503
    assert not any(r.exc_info for r in caplog.records)
    unavailable = [r for r in caplog.records if "database unavailable" in r.getMessage()]
    assert len(unavailable) <= 1, [r.getMessage() for r in unavailable]


def test_the_console_shows_a_page_saying_the_database_is_unavailable(operator_password, transactional_db):
    browser = Client(raise_request_exception=False)
    assert browser.post("/login", {"password": operator_password, "next": "/"}).status_code == 302
    saved, kept = dict(connection.settings_dict), connection.connection
    connection.connection = None
    if connection.vendor == "postgresql":
        connection.settings_dict.update(HOST="127.0.0.1", PORT=str(free_port()))
    else:
        connection.settings_dict["NAME"] = "/nonexistent-palisade-dir/palisade.sqlite3"
    try:
        response = browser.get("/policy")
    finally:
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)
        connection.connection = kept
    assert response.status_code == 503 and 5 <= int(response["Retry-After"]) <= 15
    assert response["Content-Type"].startswith("text/html")
    assert "cannot reach its database" in response.content.decode()

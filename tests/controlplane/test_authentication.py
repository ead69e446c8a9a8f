"""Operator authentication: sessions, tokens, the login throttle (spec "Authentication")."""

import io
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from rest_framework.test import APIClient

from controlplane.auth.models import OperatorSession, OperatorToken
from controlplane.auth.services import session_open
from controlplane.problems import Problem
from tests.conftest import PASSWORD
from tests.support.helpers import race
from tests.support.requirements import require

UNAUTH = "urn:service:problem:unauthenticated"


def login(client, password=PASSWORD, **headers):
    return client.post("/api/v1/session", {"password": password}, format="json", **headers)


def test_login_sets_a_strict_secure_cookie_with_a_seven_day_absolute_lifetime(anon, operator_password):
    response = login(anon)
    assert response.status_code == 200
    cookie = response.cookies["palisade_session"]
    assert cookie["secure"] and cookie["httponly"]
    assert cookie["samesite"] == "Strict"
    session = OperatorSession.objects.get()
    assert session.expires_at - session.created_at == timedelta(days=7)
    assert cookie.value.startswith("pal_s_")
    assert session.key_digest != cookie.value  # only a digest is stored
    assert anon.get("/api/v1/me").json()["credential"]["kind"] == "session"


def test_session_is_never_extended_and_refused_after_seven_days(anon, operator_password, clock_at):
    login(anon)
    expires = OperatorSession.objects.get().expires_at
    clock_at(timedelta(days=6, hours=23))
    assert anon.get("/api/v1/me").status_code == 200
    assert OperatorSession.objects.get().expires_at == expires  # use did not slide it
    clock_at(timedelta(hours=1))
    response = anon.get("/api/v1/me")
    assert response.status_code == 401
    assert response.json()["type"] == UNAUTH


def test_logout_ends_the_session_and_the_same_cookie_is_refused(anon, operator_password):
    login(anon)
    cookie = anon.cookies["palisade_session"].value
    assert anon.delete("/api/v1/session").status_code == 204
    replay = APIClient()
    replay.cookies["palisade_session"] = cookie
    response = replay.get("/api/v1/me")
    assert response.status_code == 401 and response.json()["type"] == UNAUTH


def test_wrong_password_is_401_and_repeated_failures_are_throttled_until_the_wait_is_over(
    anon, operator_password, clock_at, settings
):
    for _ in range(settings.PALISADE_LOGIN_FREE_FAILURES):
        response = login(anon, "wrong password!")
        assert response.status_code == 401
        assert response.json()["type"] == UNAUTH
    response = login(anon, "wrong password!")
    assert response.status_code == 429
    assert response.json()["type"] == "urn:service:problem:rate-limited"
    wait = int(response["Retry-After"])
    assert wait >= 1 and response.json()["retry_after"] == wait
    # Even the right password waits: otherwise the throttle would be an oracle.
    assert login(anon).status_code == 429
    clock_at(timedelta(seconds=wait))
    assert login(anon).status_code == 200


def test_throttle_is_per_client(operator_password, settings):
    attacker = APIClient(REMOTE_ADDR="192.0.2.9")
    for _ in range(settings.PALISADE_LOGIN_FREE_FAILURES + 1):
        login(attacker, "nope nope nope")
    assert login(attacker).status_code == 429
    assert login(APIClient(REMOTE_ADDR="192.0.2.10")).status_code == 200


def spend_the_shared_budget(settings) -> None:
    """Failed logins from as many addresses as it takes, each within its own free failures (a smaller
    budget than serve's 50: each failure costs an argon2 verify)."""
    settings.PALISADE_LOGIN_GLOBAL_FAILURES = 12
    per_address = settings.PALISADE_LOGIN_FREE_FAILURES
    for n in range(settings.PALISADE_LOGIN_GLOBAL_FAILURES):
        assert (
            login(APIClient(REMOTE_ADDR=f"198.51.100.{n // per_address}"), "guess guess").status_code == 401
        )


def test_failures_from_many_addresses_share_one_budget(operator_password, settings):
    """40 addresses x 5 guesses: only the shared budget is verified, the rest wait."""
    statuses = [
        login(APIClient(REMOTE_ADDR=f"198.51.100.{address}"), "guess guess").status_code
        for address in range(40)
        for _ in range(settings.PALISADE_LOGIN_FREE_FAILURES)
    ]
    assert statuses.count(401) == settings.PALISADE_LOGIN_GLOBAL_FAILURES == 50
    assert set(statuses[50:]) == {429}
    refused = login(APIClient(REMOTE_ADDR="203.0.113.1"))  # a fresh address, the right password
    assert refused.status_code == 429
    assert int(refused["Retry-After"]) == refused.json()["retry_after"] > 0
    assert "operator-login-throttle reset" in refused.json()["detail"]


def test_the_shared_wait_ends_with_its_window(operator_password, settings, clock_at):
    spend_the_shared_budget(settings)
    wait = int(login(APIClient(REMOTE_ADDR="203.0.113.1"))["Retry-After"])
    assert 0 < wait <= settings.PALISADE_LOGIN_GLOBAL_WINDOW_SECONDS
    clock_at(timedelta(seconds=wait))
    assert login(APIClient(REMOTE_ADDR="203.0.113.1")).status_code == 200


def test_a_successful_login_does_not_spend_the_shared_budget(operator_password, settings):
    settings.PALISADE_LOGIN_GLOBAL_FAILURES = 3
    for _ in range(settings.PALISADE_LOGIN_GLOBAL_FAILURES + 5):
        assert login(APIClient(REMOTE_ADDR="203.0.113.1")).status_code == 200
    assert login(APIClient(REMOTE_ADDR="203.0.113.2"), "one guess").status_code == 401


@pytest.mark.parametrize(
    "command",
    [
        ("operator-login-throttle", "reset"),
        ("operator-password", "--stdin"),
    ],
    ids=["throttle-reset", "password-reset"],
)
def test_a_host_command_lets_the_operator_back_in(operator_password, settings, command):
    spend_the_shared_budget(settings)
    attacker = APIClient(REMOTE_ADDR="198.51.100.0")
    assert login(attacker).status_code == 429
    given = {"input_stream": io.StringIO(PASSWORD + "\n")} if command[0] == "operator-password" else {}
    call_command(*command, stdout=io.StringIO(), **given)
    assert login(APIClient(REMOTE_ADDR="203.0.113.1")).status_code == 200
    assert login(attacker).status_code == 200  # each address's own wait is lifted as well


@pytest.mark.postgres
def test_concurrent_guesses_from_one_address_get_exactly_the_free_failures(transactional_db, settings):
    """The attempt is counted before the password is verified: 40 guesses at once, 5 verified."""
    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    from controlplane.auth.actor import CLI_ACTOR
    from controlplane.auth.services import operator_set_password

    operator_set_password(actor=CLI_ACTOR, password=PASSWORD)
    results = race(*[lambda: session_open(password="guess guess", client="192.0.2.7")] * 40)
    names = [r.name if isinstance(r, Problem) else repr(r) for r in results]
    assert names.count("unauthenticated") == settings.PALISADE_LOGIN_FREE_FAILURES, names
    assert names.count("rate-limited") == 40 - settings.PALISADE_LOGIN_FREE_FAILURES, names
    assert all(r.extensions["retry_after"] > 0 for r in results if getattr(r, "name", "") == "rate-limited")


def test_login_without_password_set_explains_how_to_set_it(anon):
    response = login(anon)
    assert response.status_code == 401
    assert "operator-password" in response.json()["detail"]


@pytest.mark.parametrize(
    "body, rule, path",
    [
        ({}, "required", "/password"),
        ({"password": 5}, "type", "/password"),
        ({"password": "x", "user": "a"}, "unknown-field", "/user"),
    ],
)
def test_login_body_is_validated(anon, operator_password, body, rule, path):
    response = anon.post("/api/v1/session", body, format="json")
    assert response.status_code == 422
    assert {"path": path, "rule": rule} in [
        {"path": e["path"], "rule": e["rule"]} for e in response.json()["errors"]
    ]


def test_a_stale_cookie_does_not_block_login(anon, operator_password):
    anon.cookies["palisade_session"] = "pal_s_stale"
    assert login(anon).status_code == 200


def test_password_reset_ends_sessions(anon, operator_password):
    login(anon)
    call_command("operator-password", "--stdin", input_stream=io.StringIO("another long password\n"))
    assert anon.get("/api/v1/me").status_code == 401


def test_no_api_endpoint_sets_the_password(api):
    for path in ("/api/v1/operator-password", "/api/v1/password", "/api/v1/me"):
        assert api.put(path, {"password": "x" * 20}, format="json").status_code in (404, 405)


@pytest.mark.parametrize(
    "header",
    [
        "",
        "Bearer",
        "Bearer ",
        "Basic dXNlcjpwYXNz",
        "Bearer pal_op_doesnotexist",
        "Token abc",
        "bearer pal_s_x",
    ],
)
def test_every_bad_credential_is_401_unauthenticated(db, header):
    client = APIClient()
    if header:
        client.credentials(HTTP_AUTHORIZATION=header)
    response = client.get("/api/v1/me")
    assert response.status_code == 401
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["type"] == UNAUTH
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_every_endpoint_but_login_requires_a_credential(db):
    client = APIClient()
    for method, path in [
        ("get", "/api/v1/me"),
        ("delete", "/api/v1/session"),
        ("get", "/api/v1/operator-tokens"),
        ("post", "/api/v1/operator-tokens"),
        ("delete", "/api/v1/operator-tokens/00000000-0000-0000-0000-000000000000"),
        ("get", "/api/v1/schema"),
        ("get", "/api/v1/docs"),
    ]:
        response = getattr(client, method)(path)
        assert response.status_code == 401, (method, path)


def test_me(api, settings):
    settings.PALISADE_SITE_LABEL = "eu-west lab"
    settings.PALISADE_GATEWAY_ADVERTISE = "gw.example.test:8443"
    body = api.get("/api/v1/me").json()
    assert body["site_label"] == "eu-west lab"
    assert body["gateway_address"] == "gw.example.test:8443"
    assert body["version"] == __import__("controlplane").__version__
    assert body["credential"]["kind"] == "token"


def test_token_mint_shows_plaintext_once_and_stores_a_digest(api):
    response = api.post("/api/v1/operator-tokens", {"name": "deploy bot"}, format="json")
    assert response.status_code == 201
    secret = response.json()["token"]
    assert secret.startswith("pal_op_")
    record = OperatorToken.objects.get(id=response.json()["record"]["id"])
    assert secret not in (record.digest, record.prefix) and secret.startswith(record.prefix)
    listed = api.get("/api/v1/operator-tokens").json()
    assert secret not in str(listed)
    assert {t["name"] for t in listed["items"]} == {"tests", "deploy bot"}
    assert listed["next_cursor"] is None


def test_revocation_takes_effect_on_the_next_request(api):
    minted = api.post("/api/v1/operator-tokens", {"name": "short-lived"}, format="json").json()
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Bearer {minted['token']}")
    assert other.get("/api/v1/me").status_code == 200
    assert api.delete(f"/api/v1/operator-tokens/{minted['record']['id']}").json()["revoked_at"]
    assert other.get("/api/v1/me").status_code == 401


def test_expiry_takes_effect_on_the_next_request(api, clock_at):
    minted = api.post(
        "/api/v1/operator-tokens", {"name": "x", "expires_at": "2099-01-01T00:00:00Z"}, format="json"
    ).json()
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Bearer {minted['token']}")
    assert other.get("/api/v1/me").status_code == 200
    clock_at(timedelta(days=365 * 80))
    assert other.get("/api/v1/me").status_code == 401


def test_last_used_is_recorded(api):
    api.get("/api/v1/me")
    assert OperatorToken.objects.get(name="tests").last_used_at is not None


@pytest.mark.parametrize(
    "body, path, rule",
    [
        ({}, "/name", "required"),
        ({"name": ""}, "/name", "too-short"),
        ({"name": "x", "expires_at": "tomorrow"}, "/expires_at", "instant"),
        ({"name": "x", "expires_at": "2001-01-01T00:00:00Z"}, "/expires_at", "in-the-past"),
        ({"name": "x", "scopes": ["all"]}, "/scopes", "unknown-field"),
    ],
)
def test_token_mint_validation(api, body, path, rule):
    response = api.post("/api/v1/operator-tokens", body, format="json")
    assert response.status_code == 422
    assert [(e["path"], e["rule"]) for e in response.json()["errors"]] == [(path, rule)]


def test_revoking_an_unknown_token_is_404(api):
    response = api.delete("/api/v1/operator-tokens/00000000-0000-0000-0000-000000000000")
    assert response.status_code == 404
    assert response.json()["type"] == "urn:service:problem:not-found"


def test_answers_carrying_a_secret_are_never_stored(api, anon, operator_password):
    """(Strict-Transport-Security is added where serve sends the answer: tests/e2e/test_trust_on_serve.py.)"""
    assert api.post("/api/v1/operator-tokens", {"name": "ci"}, format="json")["Cache-Control"] == "no-store"
    minted = api.post("/api/v1/provisioning-tokens", {"description": "ci"}, format="json")
    assert minted.status_code == 201 and minted["Cache-Control"] == "no-store"
    assert login(anon)["Cache-Control"] == "no-store"
    assert anon.get("/static/console/console.js").get("Cache-Control") != "no-store"

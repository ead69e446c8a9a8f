"""The API conventions every endpoint shares: problem documents, the origin guard, paging."""

import re

import pytest

from controlplane.auth.actor import CLI_ACTOR
from controlplane.auth.models import OperatorToken
from controlplane.auth.selectors import operator_token_list
from controlplane.auth.services import operator_token_mint
from controlplane.pagination import MAX_LIMIT
from controlplane.problems import PROBLEM_TYPES, ValidationFailed
from tests.conftest import PASSWORD
from tests.support.helpers import assert_problem


def test_unknown_path_is_a_404_problem(api):
    assert_problem(api.get("/api/v1/nothing-here"), 404, "not-found")
    assert_problem(api.get("/favicon.ico"), 404, "not-found")


def test_unsupported_method_is_a_405_problem(api):
    assert_problem(api.patch("/api/v1/me", {}, format="json"), 405, "method-not-allowed")


def test_oversized_body_is_a_413_problem(api, settings):
    body = assert_problem(
        api.post(
            "/api/v1/operator-tokens",
            "x" * (settings.PALISADE_MAX_BODY_BYTES + 1),
            content_type="application/json",
        ),
        413,
        "payload-too-large",
    )
    assert body["max_bytes"] == settings.PALISADE_MAX_BODY_BYTES


def test_non_json_body_is_a_415_problem(api):
    assert_problem(
        api.post("/api/v1/operator-tokens", "name=x", content_type="application/x-www-form-urlencoded"),
        415,
        "unsupported-media-type",
    )


def test_malformed_json_is_a_400_problem(api):
    assert_problem(
        api.post("/api/v1/operator-tokens", "{nope", content_type="application/json"),
        400,
        "malformed-request",
    )


def test_body_that_is_not_an_object_is_a_validation_problem(api):
    body = assert_problem(api.post("/api/v1/operator-tokens", [1, 2], format="json"), 422, "validation")
    assert body["errors"] == [{"path": "", "rule": "type", "message": "Expected a JSON object."}]


def test_unexpected_failure_is_a_500_problem_and_logged(api, monkeypatch, caplog):
    def explode():
        raise RuntimeError("boom")

    monkeypatch.setattr("controlplane.api.session.gateway_address", explode)
    body = assert_problem(api.get("/api/v1/me"), 500, "internal")
    assert "boom" not in body["detail"]  # internals stay in the host's log
    assert "boom" in caplog.text


def test_validation_findings_shape(api):
    body = assert_problem(api.post("/api/v1/operator-tokens", {"nme": "x"}, format="json"), 422, "validation")
    assert sorted((e["path"], e["rule"]) for e in body["errors"]) == [
        ("/name", "required"),
        ("/nme", "unknown-field"),
    ]
    assert all(set(e) == {"path", "rule", "message"} for e in body["errors"])


def test_every_problem_type_is_published_in_the_schema(api):
    schema = api.get("/api/v1/schema", HTTP_ACCEPT="application/json").json()
    values = schema["components"]["schemas"]["ProblemType"]["enum"]
    assert set(values) == {f"urn:service:problem:{name}" for name in PROBLEM_TYPES}


# --- cross-origin guard: Fetch Metadata, then Origin; scripts send neither and pass ---


@pytest.mark.parametrize(
    "headers, refused",
    [
        ({}, False),
        ({"HTTP_SEC_FETCH_SITE": "same-origin"}, False),
        ({"HTTP_SEC_FETCH_SITE": "none"}, False),
        ({"HTTP_SEC_FETCH_SITE": "cross-site"}, True),
        ({"HTTP_SEC_FETCH_SITE": "same-site"}, True),
        ({"HTTP_ORIGIN": "https://testserver"}, False),
        ({"HTTP_ORIGIN": "https://testserver:443"}, False),
        ({"HTTP_ORIGIN": "https://evil.example"}, True),
        ({"HTTP_ORIGIN": "http://testserver"}, True),
        ({"HTTP_ORIGIN": "https://testserver:8080"}, True),
        ({"HTTP_ORIGIN": "null"}, True),
        ({"HTTP_SEC_FETCH_SITE": "same-origin", "HTTP_ORIGIN": "https://testserver"}, False),
        ({"HTTP_SEC_FETCH_SITE": "same-origin", "HTTP_ORIGIN": "https://evil.example"}, True),
        ({"HTTP_SEC_FETCH_SITE": "cross-site", "HTTP_ORIGIN": "https://testserver"}, True),
    ],
)
def test_cross_origin_guard_on_writes(api, headers, refused):
    response = api.post("/api/v1/operator-tokens", {"name": "x"}, format="json", **headers)
    if refused:
        assert_problem(response, 403, "cross-origin")
    else:
        assert response.status_code == 201


def test_cross_origin_guard_covers_login_and_lets_reads_through(anon, operator_password):
    response = anon.post(
        "/api/v1/session", {"password": PASSWORD}, format="json", HTTP_SEC_FETCH_SITE="cross-site"
    )
    assert_problem(response, 403, "cross-origin")
    assert (
        anon.get("/api/v1/me", HTTP_SEC_FETCH_SITE="cross-site").status_code == 401
    )  # a read: not refused as cross-origin


def test_cross_origin_guard_matches_the_host_with_port(api):
    ok = api.post(
        "/api/v1/operator-tokens",
        {"name": "x"},
        format="json",
        HTTP_HOST="cp.example:8080",
        HTTP_ORIGIN="https://cp.example:8080",
    )
    assert ok.status_code == 201
    bad = api.post(
        "/api/v1/operator-tokens",
        {"name": "x"},
        format="json",
        HTTP_HOST="cp.example:8080",
        HTTP_ORIGIN="https://cp.example:9090",
    )
    assert_problem(bad, 403, "cross-origin")


# --- keyset paging ---


def mint(n):
    for i in range(n):
        operator_token_mint(actor=CLI_ACTOR, data={"name": f"t{i:03}"})


def test_pages_walk_every_item_once(api):
    mint(7)
    seen, cursor = [], None
    while True:
        url = "/api/v1/operator-tokens?limit=3" + (f"&cursor={cursor}" if cursor else "")
        body = api.get(url).json()
        assert len(body["items"]) <= 3
        seen += [t["id"] for t in body["items"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) == OperatorToken.objects.count() == 8


def test_paging_is_stable_while_items_are_added(db):
    mint(5)
    first = operator_token_list(cursor=None, limit=3)
    mint(2)  # newer items sort after the cursor: the walk still sees each item once
    rest = operator_token_list(cursor=first.next_cursor, limit=100)
    ids = [t.id for t in first.items + rest.items]
    assert len(ids) == len(set(ids)) == 7


@pytest.mark.parametrize("limit", ["0", "-1", str(MAX_LIMIT + 1), "ten"])
def test_limit_is_bounded(api, limit):
    body = assert_problem(api.get(f"/api/v1/operator-tokens?limit={limit}"), 422, "validation")
    assert body["errors"][0]["path"] == "?limit"


def test_forged_cursor_is_a_validation_problem(api):
    mint(3)
    cursor = api.get("/api/v1/operator-tokens?limit=1").json()["next_cursor"]
    forged = cursor[:-3] + ("AAA" if not cursor.endswith("AAA") else "BBB")
    body = assert_problem(api.get(f"/api/v1/operator-tokens?cursor={forged}"), 422, "validation")
    assert body["errors"][0]["rule"] == "cursor-invalid"
    body = assert_problem(api.get("/api/v1/operator-tokens?cursor=garbage"), 422, "validation")
    assert body["errors"][0]["rule"] == "cursor-invalid"


def test_cursor_from_another_list_is_stale(db):
    from django.core import signing

    stale = signing.dumps(
        {"f": "another-list", "k": ["2026-01-01", "x"]}, salt="palisade.cursor", compress=True
    )
    with pytest.raises(ValidationFailed) as raised:
        operator_token_list(cursor=stale, limit=10)
    assert raised.value.findings[0].rule == "cursor-stale"


def test_gateway_paths_are_not_served_on_the_operator_listener(api):
    assert_problem(api.get("/agent/v1/info"), 404, "not-found")


def test_docs_ui_needs_no_cdn(api):
    page = api.get("/api/v1/docs").content.decode()
    # Any address outside the service: a script, style or font from a CDN (a bare "cdn" also turned up
    # inside the page's random values now and then).
    assert not re.findall(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", page, flags=re.IGNORECASE)
    assert "unpkg" not in page.lower() and "jsdelivr" not in page.lower()

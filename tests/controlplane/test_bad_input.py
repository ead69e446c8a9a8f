"""Hand-made bad input that once gave a 500, a traceback or mangled data: each is a problem document
now, and nothing of it is stored. Runs on SQLite and PostgreSQL (CI)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.models import AddressGroup, Service
from tests.support.helpers import assert_problem

JSON_ENDPOINTS = [
    "/api/v1/session",
    "/api/v1/operator-tokens",
    "/api/v1/provisioning-tokens",
    "/api/v1/services",
    "/api/v1/address-groups",
    "/api/v1/rulesets",
    "/api/v1/selectors/preview",
    "/api/v1/policies/render-dryrun",
    "/api/v1/policies/suggestions",
    "/api/v1/mode-changes",
]


def post_raw(api, path, raw, content_type="application/json"):
    return api.post(path, raw, content_type=content_type)


@pytest.mark.parametrize("path", JSON_ENDPOINTS)
def test_json_nested_ten_thousand_levels_is_a_400(api, path):
    body = assert_problem(post_raw(api, path, "[" * 10_000 + "]" * 10_000), 400, "malformed-request")
    assert "nested" in body["detail"]


def test_nesting_within_the_parser_limit_but_beyond_ours_is_a_400(api):
    body = assert_problem(post_raw(api, "/api/v1/services", "[" * 200 + "]" * 200), 400, "malformed-request")
    assert "nested more than 32 levels" in body["detail"]


def test_deep_nesting_without_a_credential_is_a_400_too(anon):
    # POST /session needs no credential: the parser's refusal must not depend on one.
    assert_problem(post_raw(anon, "/api/v1/session", '{"password":' + "[" * 10_000), 400, "malformed-request")


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ('{"name": "a\\ud800b", "entries": [{"protocol": "tcp", "port": 1}]}', "surrogate"),
        ('{"name": "a\\u0000b", "entries": [{"protocol": "tcp", "port": 1}]}', "NUL"),
        ('{"name\\u0000": "x"}', "NUL"),
        ('{"name": "n", "entries": [{"protocol": "tcp", "port": ' + "9" * 5000 + "}]}", "too many digits"),
        ('{"name": "n", "entries": [{"protocol": "tcp", "port": ' + "9" * 41 + "}]}", "too many digits"),
        ('{"name": "n", "entries": [], "x": -1.' + "5" * 39 + "}", "too many digits"),
        ('{"name": "n", "entries": [], "x": NaN}', "NaN is not JSON"),
        ('{"name": "n", "entries": [], "x": -Infinity}', "-Infinity is not JSON"),
        (b'{"name": "caf\xff"}', "not UTF-8"),
    ],
    ids=[
        "lone-surrogate",
        "nul-in-value",
        "nul-in-key",
        "huge-number",
        "41-digits",
        "long-float",
        "nan",
        "infinity",
        "not-utf8",
    ],  # fmt: skip
)
def test_strings_and_numbers_json_cannot_carry_safely_are_400s(api, raw, fragment):
    body = assert_problem(post_raw(api, "/api/v1/services", raw), 400, "malformed-request")
    assert fragment in body["detail"]
    assert "sys." not in body["detail"] and "codec" not in body["detail"] and "0xff" not in body["detail"]
    assert not Service.objects.exists()


@pytest.mark.parametrize(
    "raw",
    [
        '{"n": ' + "9" * 40 + ', "s": "' + "1" * 60 + '"}',
        '{"s": "NaN and Infinity, as text", "e": -1.5e+300}',
    ],
    ids=["forty-digits-and-a-long-digit-string", "constants-named-in-a-string"],
)
def test_json_that_only_looks_like_a_refused_number_parses_exactly(raw):
    from controlplane.strict_json import json_loads_strict

    assert json_loads_strict(raw.encode()) == json.loads(raw) == json_loads_strict(raw)


@given(text=st.text(alphabet='NaNInfinity\\u00{}[]"1e+-.: é\u2028\U0001f600', max_size=60))
@settings(max_examples=400, deadline=None)
def test_strict_json_byte_gates_decide_as_the_searches_they_skip(text):
    """The one-byte gates before the word searches (`_needs_hooks`, `_has_escape`) decide exactly as
    the searches alone: a gate that skipped a NaN, an Infinity or a \\u escape would let a refused
    value through unchecked."""
    from controlplane.strict_json import _NUMBER_CHARACTERS, _TOO_LONG_RUN, _has_escape, _needs_hooks

    raw = text.encode()
    assert _needs_hooks(raw) == (
        b"NaN" in raw or b"Infinity" in raw or _TOO_LONG_RUN in raw.translate(_NUMBER_CHARACTERS)
    )
    assert _has_escape(raw) == ("\\u" in text)


@pytest.mark.parametrize("charset", ["latin-1", "utf-7", "cp500", "utf-16"])
def test_a_body_in_another_charset_is_a_415_and_nothing_is_stored(api, charset):
    raw = json.dumps({"name": "café", "entries": [{"protocol": "tcp", "port": 80}]}, ensure_ascii=False)
    response = post_raw(
        api, "/api/v1/services", raw.encode("latin-1"), content_type=f"application/json; charset={charset}"
    )
    assert_problem(response, 415, "unsupported-media-type")
    assert not Service.objects.exists()


@pytest.mark.parametrize("charset", ["", "; charset=utf-8", '; charset="UTF-8"'])
def test_utf8_bodies_store_exactly_what_was_sent(api, charset):
    raw = json.dumps({"name": "café", "entries": [{"protocol": "tcp", "port": 80}]}, ensure_ascii=False)
    response = post_raw(api, "/api/v1/services", raw.encode(), content_type="application/json" + charset)
    assert response.status_code == 201, response.content
    assert api.get(f"/api/v1/services/{response.json()['id']}").json()["name"] == "café"


@pytest.mark.parametrize("member", ["fe80::1%eth0", "fe80::1%1", "fe80::%x/64", "::1%"])
def test_an_address_group_member_with_an_ipv6_zone_is_refused(api, member):
    body = assert_problem(
        api.post("/api/v1/address-groups", {"name": "g", "members": [member]}, format="json"),
        422,
        "validation",
    )
    assert body["errors"][0]["path"] == "/members/0" and body["errors"][0]["rule"] == "address-zone"
    assert not AddressGroup.objects.exists()


@pytest.mark.parametrize(
    "text", ["evil\u202etxt.exe", "a\u2066b", "line\nbreak", "bell\x07", "del\x7f", "c1\x85"], ids=repr
)
@pytest.mark.parametrize("field", ["name", "description"])
def test_names_and_descriptions_refuse_control_and_bidi_characters(api, field, text):
    data = {"name": "web", "description": "", "entries": [{"protocol": "tcp", "port": 80}]}
    data[field] = text
    body = assert_problem(api.post("/api/v1/services", data, format="json"), 422, "validation")
    assert (f"/{field}", "unsafe-character") in [(e["path"], e["rule"]) for e in body["errors"]]


def test_an_expiry_past_the_last_representable_instant_is_a_finding(api):
    body = assert_problem(
        api.post(
            "/api/v1/provisioning-tokens",
            {"description": "d", "expires_at": "9999-12-31T23:59:59-14:00"},
            format="json",
        ),
        422,
        "validation",
    )
    assert body["errors"][0]["path"] == "/expires_at"


def test_an_unknown_field_of_eight_kilobytes_is_not_echoed_back(api):
    body = assert_problem(
        api.post("/api/v1/services", {"x" * 8192: 1, "name": "n", "entries": []}, format="json"),
        422,
        "validation",
    )
    assert len(json.dumps(body)) < 2000


def test_the_host_command_refuses_the_same_json(db, tmp_path):
    from tests.support.helpers import run_command

    source = tmp_path / "service.json"
    source.write_text('{"name": "a\\u0000b", "entries": [{"protocol": "tcp", "port": 1}]}')
    code, out, err = run_command("service", "create", str(source))
    assert code != 0 and "NUL" in err and "Traceback" not in err


def test_an_invalid_session_cookie_beside_a_valid_token_is_refused(api):
    from django.conf import settings

    api.cookies[settings.PALISADE_SESSION_COOKIE] = "not-a-session"
    body = assert_problem(api.get("/api/v1/me"), 401, "unauthenticated")
    assert "cookie" in body["detail"]


@pytest.fixture
def service(api):
    response = api.post(
        "/api/v1/services", {"name": "web", "entries": [{"protocol": "tcp", "port": 80}]}, format="json"
    )
    return response.json()


def test_a_weak_etag_never_matches_if_match(api, service):
    response = api.put(
        f"/api/v1/services/{service['id']}",
        {"name": "web2", "entries": [{"protocol": "tcp", "port": 80}]},
        format="json",
        HTTP_IF_MATCH=f'W/"{service["version"]}"',
    )
    body = assert_problem(response, 412, "precondition-failed")
    assert body["current_version"] == service["version"] and "weak" in body["detail"].lower()
    assert api.get(f"/api/v1/services/{service['id']}").json()["name"] == "web"


@pytest.mark.parametrize(
    "header, status, name, fragment",
    [
        ('"1", "2"', 428, "precondition-required", "not a list"),
        ("*", 428, "precondition-required", "`*`"),
        ('"' + "9" * 8192 + '"', 400, "malformed-request", "longer than"),
    ],
    ids=["list", "star", "8kb"],
)
def test_if_match_that_is_not_one_version_says_why_without_echoing_it(
    api, service, header, status, name, fragment
):
    response = api.delete(f"/api/v1/services/{service['id']}", HTTP_IF_MATCH=header)
    body = assert_problem(response, status, name)
    assert fragment in body["detail"] and len(body["detail"]) < 300


@pytest.mark.parametrize(
    "text",
    [
        "2026-11-29T02:00:00.123456Z",
        "2024-02-29T23:59:59.999999Z",
        "9999-12-31T23:59:59.999999Z",
        "2026-13-01T00:00:00.000000Z",  # month 13
        "2026-02-30T00:00:00.000000Z",
        "2026-01-01T24:00:00.000000Z",
        "2026-01-01T00:00:0 .000000Z",  # not a digit where one belongs
        "2026-01-01T00:00:00.00000+Z",
        "2026-01-01T00:00:00.-00000Z",
        "+026-01-01T00:00:00.000000Z",
        "2026-01-01T00:00:00.00000\u0663Z",  # an Arabic-Indic digit
    ],
)
def test_an_instant_in_the_agents_form_parses_as_it_does_with_an_offset(text):
    """Flow reports' instants (`...SS.ffffffZ`) take a shorter way through the parse: the same
    instant, or the same refusal, as the instant written with +00:00 (the pattern's way)."""
    from datetime import UTC

    from controlplane.validation import parse_instant

    parsed, by_pattern = parse_instant(text), parse_instant(text[:-1] + "+00:00")
    assert parsed == by_pattern
    assert parsed is None or parsed.tzinfo is UTC

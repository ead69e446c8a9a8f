"""The policy endpoints over the API: every success and failure path of the spec's policy table."""

import pytest

from tests.support.helpers import assert_problem

HTTPS = {"protocol": "tcp", "port": 443}


def create(api, path, body):
    response = api.post(path, body, format="json")
    assert response.status_code == 201, response.content
    assert response["ETag"] == f'"{response.json()["version"]}"'
    return response.json()


def put(api, path, body, version):
    return api.put(path, body, format="json", HTTP_IF_MATCH=f'"{version}"')


def delete(api, path, version=None):
    headers = {"HTTP_IF_MATCH": f'"{version}"'} if version is not None else {}
    return api.delete(path, **headers)


@pytest.fixture
def web(api):
    return create(
        api,
        "/api/v1/services",
        {"name": "web", "entries": [HTTPS, {"protocol": "tcp", "port": 8000, "port_to": 8080}]},
    )


@pytest.fixture
def office(api):
    return create(
        api,
        "/api/v1/address-groups",
        {"name": "office", "members": ["10.1.0.0/16", "2001:DB8::1", "192.0.2.7/32"]},
    )


@pytest.fixture
def ruleset(api, web, office):
    return create(
        api,
        "/api/v1/rulesets",
        {
            "name": "frontend",
            "description": "who may reach the web tier",
            "scope": "tier=web, env in (prod,staging)",
            "rules": [
                {
                    "description": "clients",
                    "sources": [{"selector": "role=client"}],
                    "services": [{"service": web["id"]}],
                },
                {
                    "sources": [{"address_group": "office"}, {"any": True}],
                    "services": [{"protocol": "icmp"}, {"service": "web"}],
                },
            ],
        },
    )


# --- services and address groups ---


def test_service_create_read_replace_delete(api, web):
    assert web["entries"] == [HTTPS, {"protocol": "tcp", "port": 8000, "port_to": 8080}]
    got = api.get(f"/api/v1/services/{web['id']}")
    assert got.json() == web and got["ETag"] == f'"{web["version"]}"'
    replaced = put(api, f"/api/v1/services/{web['id']}", {**got.json(), "entries": [HTTPS]}, web["version"])
    assert replaced.status_code == 200
    assert replaced.json()["version"] != web["version"]
    assert replaced.json()["entries"] == [HTTPS]
    assert_problem(delete(api, f"/api/v1/services/{web['id']}", web["version"]), 412, "precondition-failed")
    assert delete(api, f"/api/v1/services/{web['id']}", replaced.json()["version"]).status_code == 204
    assert_problem(api.get(f"/api/v1/services/{web['id']}"), 404, "not-found")


def test_address_group_members_are_normalised(office):
    assert office["members"] == ["10.1.0.0/16", "192.0.2.7", "2001:db8::1"]


def test_lists_carry_the_policy_version(api, web, office):
    services = api.get("/api/v1/services").json()
    groups = api.get("/api/v1/address-groups").json()
    assert [s["name"] for s in services["services"]] == ["web"]
    assert [g["name"] for g in groups["address_groups"]] == ["office"]
    assert services["policy_version"] == groups["policy_version"]


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"entries": [HTTPS]}, [("/name", "required")]),
        ({"name": "x", "entries": []}, [("/entries", "empty")]),
        ({"name": "x", "entries": [{"protocol": "sctp", "port": 1}]}, [("/entries/0/protocol", "protocol")]),
        ({"name": "x", "entries": [{"protocol": "tcp"}]}, [("/entries/0/port", "port-required")]),
        ({"name": "x", "entries": [{"protocol": "tcp", "port": 0}]}, [("/entries/0/port", "out-of-range")]),
        (
            {"name": "x", "entries": [{"protocol": "udp", "port": 70000}]},
            [("/entries/0/port", "out-of-range")],
        ),
        (
            {"name": "x", "entries": [{"protocol": "tcp", "port": 90, "port_to": 80}]},
            [("/entries/0/port_to", "port-range-order")],
        ),
        (
            {"name": "x", "entries": [{"protocol": "icmp", "port": 8}]},
            [("/entries/0/port", "port-not-allowed")],
        ),
        ({"name": "x", "entries": [{"protocol": "tcp", "port": "80"}]}, [("/entries/0/port", "type")]),
        ({"name": "x", "entries": [HTTPS], "colour": "red"}, [("/colour", "unknown-field")]),
        ({"name": "x" * 101, "entries": [HTTPS]}, [("/name", "too-long")]),
        ({"name": "x", "entries": [HTTPS] * 65}, [("/entries", "too-many")]),
    ],
)
def test_service_validation_findings(api, body, expected):
    body = assert_problem(api.post("/api/v1/services", body, format="json"), 422, "validation")
    assert [(e["path"], e["rule"]) for e in body["errors"]] == expected


def test_one_finding_per_field(api):
    body = {"name": "", "entries": [{"protocol": "tcp"}, {"protocol": "icmp", "port_to": 3}], "x": 1}
    errors = assert_problem(api.post("/api/v1/services", body, format="json"), 422, "validation")["errors"]
    assert sorted((e["path"], e["rule"]) for e in errors) == [
        ("/entries/0/port", "port-required"),
        ("/entries/1/port_to", "port-not-allowed"),
        ("/name", "too-short"),
        ("/x", "unknown-field"),
    ]


@pytest.mark.parametrize(
    "member, rule",
    [
        ("10.0.0.300", "address"),
        ("10.0.0.5/24", "cidr-host-bits"),
        ("example.com", "address"),
        ("", "address"),
        (5, "type"),
    ],
)
def test_address_group_member_findings(api, member, rule):
    body = assert_problem(
        api.post("/api/v1/address-groups", {"name": "g", "members": [member]}, format="json"),
        422,
        "validation",
    )
    assert [(e["path"], e["rule"]) for e in body["errors"]] == [("/members/0", rule)]


def test_duplicate_names_are_refused(api, web, office):
    body = assert_problem(
        api.post("/api/v1/services", {"name": "web", "entries": [HTTPS]}, format="json"), 422, "validation"
    )
    assert body["errors"][0]["rule"] == "duplicate-name"
    other = create(api, "/api/v1/address-groups", {"name": "other", "members": []})
    body = assert_problem(
        put(
            api, f"/api/v1/address-groups/{other['id']}", {"name": "office", "members": []}, other["version"]
        ),
        422,
        "validation",
    )
    assert body["errors"][0]["rule"] == "duplicate-name"


def test_referenced_service_and_group_cannot_be_deleted(api, ruleset, web, office):
    body = assert_problem(delete(api, f"/api/v1/services/{web['id']}", web["version"]), 409, "in-use")
    assert {r["rule_id"] for r in body["referenced_by"]} == {r["id"] for r in ruleset["rules"]}
    assert "frontend" in body["detail"]
    body = assert_problem(
        delete(api, f"/api/v1/address-groups/{office['id']}", office["version"]), 409, "in-use"
    )
    assert [r["rule_id"] for r in body["referenced_by"]] == [ruleset["rules"][1]["id"]]


# --- conditional writes ---


@pytest.mark.parametrize("kind", ["services", "address-groups", "rulesets"])
def test_writes_without_if_match_are_428_and_with_a_moved_version_412(api, ruleset, web, office, kind):
    obj = {"services": web, "address-groups": office, "rulesets": ruleset}[kind]
    path = f"/api/v1/{kind}/{obj['id']}"
    current = api.get(path).json()
    assert_problem(api.put(path, current, format="json"), 428, "precondition-required")
    assert_problem(api.delete(path), 428, "precondition-required")
    body = assert_problem(put(api, path, current, "999"), 412, "precondition-failed")
    assert body["current_version"] == current["version"]
    assert_problem(api.delete(path, HTTP_IF_MATCH='"999"'), 412, "precondition-failed")


@pytest.mark.parametrize("kind", ["services", "address-groups", "rulesets"])
def test_unknown_ids_are_404(api, kind):
    for object_id in ("00000000-0000-0000-0000-000000000000", "not-a-uuid"):
        path = f"/api/v1/{kind}/{object_id}"
        assert_problem(api.get(path), 404, "not-found")
        assert_problem(put(api, path, {}, "1"), 404, "not-found")
        assert_problem(delete(api, path, "1"), 404, "not-found")


def test_unauthenticated_policy_requests_are_401(db):
    from rest_framework.test import APIClient

    client = APIClient()
    for path in ("/api/v1/rulesets", "/api/v1/services", "/api/v1/address-groups"):
        assert_problem(client.get(path), 401, "unauthenticated")
        assert_problem(client.post(path, {}, format="json"), 401, "unauthenticated")


# --- rulesets and rules ---


def test_ruleset_shape_and_scope_is_canonical(api, ruleset, web, office):
    assert ruleset["scope"] == "env in (prod,staging),tier=web"
    assert ruleset["enabled"] is True
    first, second = ruleset["rules"]
    assert first["sources"] == [{"selector": "role=client"}]
    assert first["services"] == [{"service": web["id"]}]
    assert second["sources"] == [{"address_group": office["id"]}, {"any": True}]
    assert second["services"] == [{"protocol": "icmp"}, {"service": web["id"]}]
    listed = api.get("/api/v1/rulesets").json()
    assert [r["id"] for r in listed["rulesets"]] == [ruleset["id"]]


def policy_version(api):
    return api.get("/api/v1/rulesets").json()["policy_version"]


def test_policy_version_moves_with_every_policy_write(api, ruleset, web, office):
    seen = {policy_version(api)}

    def moved():
        version = policy_version(api)
        assert version not in seen
        seen.add(version)

    put(api, f"/api/v1/services/{web['id']}", {"name": "web", "entries": [HTTPS]}, web["version"])
    moved()
    put(api, f"/api/v1/address-groups/{office['id']}", {"name": "office", "members": []}, office["version"])
    moved()
    rule = ruleset["rules"][0]
    put(
        api,
        f"/api/v1/rulesets/{ruleset['id']}/rules/{rule['id']}",
        {**rule, "description": "x"},
        rule["version"],
    )
    moved()
    create(api, "/api/v1/services", {"name": "dns", "entries": [{"protocol": "udp", "port": 53}]})
    moved()
    failed = put(api, f"/api/v1/services/{web['id']}", {"name": "web", "entries": [HTTPS]}, "999")
    assert failed.status_code == 412
    assert policy_version(api) in seen  # a refused write moves nothing


def test_ruleset_put_keeps_carried_rules_adds_new_and_removes_the_rest(api, ruleset):
    kept, dropped = ruleset["rules"]
    body = {
        "name": "frontend",
        "scope": "tier=web",
        "rules": [
            {"sources": [{"any": True}], "services": [{"protocol": "udp", "port": 53}]},
            kept,
        ],
    }
    response = put(api, f"/api/v1/rulesets/{ruleset['id']}", body, ruleset["version"])
    assert response.status_code == 200, response.content
    rules = response.json()["rules"]
    assert len(rules) == 2
    assert rules[1]["id"] == kept["id"]
    assert rules[0]["id"] not in (kept["id"], dropped["id"])
    assert_problem(api.get(f"/api/v1/rulesets/{ruleset['id']}/rules/{dropped['id']}"), 404, "not-found")
    assert response.json()["version"] != ruleset["version"]
    assert response["ETag"] == f'"{response.json()["version"]}"'


def test_ruleset_put_unchanged_rule_keeps_its_version(api, ruleset):
    body = {**ruleset, "description": "new words"}
    response = put(api, f"/api/v1/rulesets/{ruleset['id']}", body, ruleset["version"])
    assert [r["version"] for r in response.json()["rules"]] == [r["version"] for r in ruleset["rules"]]


def test_ruleset_put_with_a_foreign_rule_id(api, ruleset):
    body = {**ruleset, "rules": [{**ruleset["rules"][0], "id": "00000000-0000-0000-0000-000000000001"}]}
    problem = assert_problem(
        put(api, f"/api/v1/rulesets/{ruleset['id']}", body, ruleset["version"]), 422, "validation"
    )
    assert [(e["path"], e["rule"]) for e in problem["errors"]] == [("/rules/0/id", "unknown-rule")]


def test_one_rule_add_read_replace_delete_moves_the_ruleset_version(api, ruleset):
    base = f"/api/v1/rulesets/{ruleset['id']}/rules"
    rule = create(
        api, base, {"sources": [{"selector": "team=ops"}], "services": [{"protocol": "tcp", "port": 22}]}
    )
    assert rule["sources"] == [{"selector": "team=ops"}]
    after_add = api.get(f"/api/v1/rulesets/{ruleset['id']}").json()
    assert after_add["version"] != ruleset["version"] and after_add["rules"][-1]["id"] == rule["id"]
    got = api.get(f"{base}/{rule['id']}")
    assert got.json() == rule and got["ETag"] == f'"{rule["version"]}"'
    assert_problem(api.put(f"{base}/{rule['id']}", rule, format="json"), 428, "precondition-required")
    # The rule's own version, not the ruleset's, is what If-Match carries.
    assert_problem(put(api, f"{base}/{rule['id']}", rule, after_add["version"]), 412, "precondition-failed")
    replaced = put(
        api,
        f"{base}/{rule['id']}",
        {**rule, "services": [{"protocol": "tcp", "port": 2222}]},
        rule["version"],
    )
    assert replaced.status_code == 200 and replaced.json()["services"] == [{"protocol": "tcp", "port": 2222}]
    after_replace = api.get(f"/api/v1/rulesets/{ruleset['id']}").json()
    assert after_replace["version"] != after_add["version"]
    body = assert_problem(delete(api, f"{base}/{rule['id']}", rule["version"]), 412, "precondition-failed")
    assert body["current_version"] == replaced.json()["version"]
    assert delete(api, f"{base}/{rule['id']}", replaced.json()["version"]).status_code == 204
    assert_problem(api.get(f"{base}/{rule['id']}"), 404, "not-found")
    assert api.get(f"/api/v1/rulesets/{ruleset['id']}").json()["version"] != after_replace["version"]


def test_rule_of_another_ruleset_is_404(api, ruleset):
    other = create(api, "/api/v1/rulesets", {"name": "other", "scope": "", "rules": []})
    rule_id = ruleset["rules"][0]["id"]
    assert_problem(api.get(f"/api/v1/rulesets/{other['id']}/rules/{rule_id}"), 404, "not-found")
    assert_problem(delete(api, f"/api/v1/rulesets/{other['id']}/rules/{rule_id}", "1"), 404, "not-found")


def test_ruleset_delete_removes_its_rules_and_frees_references(api, ruleset, web):
    assert delete(api, f"/api/v1/rulesets/{ruleset['id']}", ruleset["version"]).status_code == 204
    assert_problem(api.get(f"/api/v1/rulesets/{ruleset['id']}"), 404, "not-found")
    assert delete(api, f"/api/v1/services/{web['id']}", web["version"]).status_code == 204


@pytest.mark.parametrize(
    "rule, expected",
    [
        ({"sources": [], "services": [HTTPS]}, [("/rules/0/sources", "empty")]),
        ({"sources": [{"any": True}], "services": []}, [("/rules/0/services", "empty")]),
        ({"services": [HTTPS]}, [("/rules/0/sources", "required")]),
        (
            {"sources": [{"selector": "a in (b"}], "services": [HTTPS]},
            [("/rules/0/sources/0/selector", "selector-syntax")],
        ),
        (
            {"sources": [{"address_group": "nope"}], "services": [HTTPS]},
            [("/rules/0/sources/0/address_group", "unknown-reference")],
        ),
        (
            {"sources": [{"any": True}], "services": [{"service": "nope"}]},
            [("/rules/0/services/0/service", "unknown-reference")],
        ),
        ({"sources": [{"any": False}], "services": [HTTPS]}, [("/rules/0/sources/0/any", "type")]),
        (
            {"sources": [{"any": True, "selector": "a"}], "services": [HTTPS]},
            [("/rules/0/sources/0", "source")],
        ),
        (
            {"sources": [{"cidr": "10.0.0.0/8"}], "services": [HTTPS]},
            [("/rules/0/sources/0/cidr", "unknown-field")],
        ),
        (
            {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 99999}]},
            [("/rules/0/services/0/port", "out-of-range")],
        ),
        (
            {"sources": [{"any": True}], "services": [HTTPS], "action": "drop"},
            [("/rules/0/action", "action")],
        ),
        (
            {"sources": [{"any": True}], "services": [HTTPS], "action": ["deny"]},
            [("/rules/0/action", "action")],
        ),
        (
            {"sources": [{"any": True}], "services": [HTTPS], "action": None},
            [("/rules/0/action", "action")],
        ),
    ],
)
def test_rule_findings_point_into_the_body(api, rule, expected):
    body = {"name": "r", "scope": "app=x", "rules": [rule]}
    problem = assert_problem(api.post("/api/v1/rulesets", body, format="json"), 422, "validation")
    assert [(e["path"], e["rule"]) for e in problem["errors"]] == expected


def test_selector_finding_names_the_position(api):
    problem = assert_problem(
        api.post("/api/v1/rulesets", {"name": "r", "scope": "app=x,,b"}, format="json"), 422, "validation"
    )
    (finding,) = problem["errors"]
    assert finding["path"] == "/scope" and "position 6" in finding["message"]


def test_ruleset_requires_a_scope(api):
    problem = assert_problem(api.post("/api/v1/rulesets", {"name": "r"}, format="json"), 422, "validation")
    assert [(e["path"], e["rule"]) for e in problem["errors"]] == [("/scope", "required")]


def test_rule_numbers_are_given_once_and_never_reused(api):
    """The ct mark names a rule by this number in every policy version, so no other rule may get it."""
    created = api.post(
        "/api/v1/rulesets",
        {
            "name": "numbers",
            "scope": "",
            "rules": [
                {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 80}]},
                {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 81}]},
            ],
        },
        format="json",
    ).json()
    first, second = (rule["number"] for rule in created["rules"])
    assert second == first + 1
    path = f"/api/v1/rulesets/{created['id']}"
    deleted = api.delete(
        f"{path}/rules/{created['rules'][1]['id']}", HTTP_IF_MATCH=f'"{created["rules"][1]["version"]}"'
    )
    assert deleted.status_code == 204
    added = api.post(
        f"{path}/rules",
        {"sources": [{"any": True}], "services": [{"protocol": "udp", "port": 53}]},
        format="json",
    )
    assert added.json()["number"] == second + 1  # not the deleted rule's number
    ruleset = api.get(path).json()
    kept, new = (
        ruleset["rules"][0],
        {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 82}]},
    )
    replaced = api.put(
        path,
        {
            "name": "numbers",
            "scope": "",
            "rules": [new, {"id": kept["id"], "sources": kept["sources"], "services": kept["services"]}],
        },
        format="json",
        HTTP_IF_MATCH=f'"{ruleset["version"]}"',
    ).json()
    assert [rule["number"] for rule in replaced["rules"]] == [
        second + 2,
        first,
    ]  # a kept rule keeps its number


def test_a_rule_is_an_allow_rule_unless_it_says_deny(api, ruleset):
    assert [r["action"] for r in ruleset["rules"]] == ["allow", "allow"]
    added = api.post(
        f"/api/v1/rulesets/{ruleset['id']}/rules",
        {"action": "deny", "sources": [{"selector": "role=scanner"}], "services": [HTTPS]},
        format="json",
    )
    assert added.status_code == 201 and added.json()["action"] == "deny"
    rule = added.json()
    back = put(
        api,
        f"/api/v1/rulesets/{ruleset['id']}/rules/{rule['id']}",
        {**rule, "action": "allow"},
        rule["version"],
    )
    assert back.status_code == 200 and back.json()["action"] == "allow"
    assert back.json()["version"] != rule["version"]
    current = api.get(f"/api/v1/rulesets/{ruleset['id']}").json()
    current["rules"][0]["action"] = "deny"
    replaced = put(api, f"/api/v1/rulesets/{ruleset['id']}", current, current["version"])
    assert [r["action"] for r in replaced.json()["rules"]] == ["deny", "allow", "allow"]
    # the rule whose action changed gets a new version; the others keep theirs
    versions = [r["version"] for r in replaced.json()["rules"]]
    assert versions[0] != current["rules"][0]["version"] and versions[1:] == [
        r["version"] for r in current["rules"][1:]
    ]
    problem = assert_problem(
        put(
            api,
            f"/api/v1/rulesets/{ruleset['id']}/rules/{rule['id']}",
            {**rule, "action": "Deny"},
            back.json()["version"],
        ),
        422,
        "validation",
    )
    assert [(e["path"], e["rule"]) for e in problem["errors"]] == [("/action", "action")]

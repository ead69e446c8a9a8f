"""The host commands admit and refuse exactly what the API does, with the same findings."""

import json

import pytest
from django.core.management import CommandError

from tests.support.helpers import assert_problem
from tests.support.helpers import run_command as run

BAD_BODIES = [
    (
        "service",
        "/api/v1/services",
        {"name": "", "entries": [{"protocol": "tcp", "port": 0}, {"protocol": "icmp", "port": 1}]},
    ),
    ("address-group", "/api/v1/address-groups", {"name": "g", "members": ["10.0.0.1/8", "nope"], "x": 1}),
    (
        "ruleset",
        "/api/v1/rulesets",
        {
            "name": "r",
            "scope": "a in (",
            "rules": [{"sources": [{"address_group": "missing"}], "services": []}],
        },
    ),
]


@pytest.mark.parametrize("command, path, body", BAD_BODIES)
def test_cli_and_api_give_the_same_findings(api, monkeypatch, command, path, body):
    api_problem = assert_problem(api.post(path, body, format="json"), 422, "validation")
    code, out, _ = run(command, "create", "-", "--json", stdin_text=json.dumps(body), monkeypatch=monkeypatch)
    assert code == 2
    assert json.loads(out)["errors"] == api_problem["errors"]
    code, _, err = run(command, "create", "-", stdin_text=json.dumps(body), monkeypatch=monkeypatch)
    assert code == 2
    assert len(err.strip().splitlines()) == len(api_problem["errors"])
    assert all(line.startswith("error: ") for line in err.strip().splitlines())


def test_cli_create_replace_delete_round_trip(api, monkeypatch, tmp_path):
    spec = tmp_path / "svc.json"
    spec.write_text(json.dumps({"name": "dns", "entries": [{"protocol": "udp", "port": 53}]}))
    code, out, _ = run("service", "create", str(spec), "--json")
    created = json.loads(out)
    assert code == 0 and api.get(f"/api/v1/services/{created['id']}").json() == created
    spec.write_text(json.dumps({"name": "dns", "entries": [{"protocol": "udp", "port": 5353}]}))
    code, _, err = run("service", "replace", created["id"], str(spec), "--if-match", "999")
    assert code == 1 and "precondition-failed" in err and len(err.strip().splitlines()) == 1
    code, out, _ = run(
        "service", "replace", created["id"], str(spec), "--if-match", created["version"], "--json"
    )
    replaced = json.loads(out)
    assert code == 0 and replaced["entries"] == [{"protocol": "udp", "port": 5353}]
    code, out, _ = run("service", "list", "--json")
    assert [s["name"] for s in json.loads(out)] == ["dns"]
    code, _, _ = run("service", "delete", created["id"], "--if-match", replaced["version"])
    assert code == 0
    assert api.get(f"/api/v1/services/{created['id']}").status_code == 404


def test_cli_rule_commands_and_in_use_refusal(api, monkeypatch):
    svc = api.post(
        "/api/v1/services", {"name": "ssh", "entries": [{"protocol": "tcp", "port": 22}]}, format="json"
    ).json()
    rs = api.post("/api/v1/rulesets", {"name": "ops", "scope": "role=bastion"}, format="json").json()
    rule_body = json.dumps({"sources": [{"selector": "team=ops"}], "services": [{"service": "ssh"}]})
    code, out, _ = run("rule", "add", rs["id"], "-", "--json", stdin_text=rule_body, monkeypatch=monkeypatch)
    rule = json.loads(out)
    assert code == 0 and rule["services"] == [{"service": svc["id"]}]
    code, _, err = run("service", "delete", svc["id"], "--if-match", svc["version"])
    assert code == 1 and "in-use" in err and "ops" in err
    with pytest.raises(CommandError, match="--if-match"):
        run("rule", "delete", rs["id"], rule["id"])
    code, _, _ = run("rule", "delete", rs["id"], rule["id"], "--if-match", rule["version"])
    assert code == 0


def test_cli_unreadable_file_and_bad_json_are_one_line_errors(db, tmp_path):
    code, _, err = run("service", "create", str(tmp_path / "missing.json"))
    assert code == 1 and err.count("\n") == 1 and "cannot read" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    code, _, err = run("service", "create", str(bad))
    assert code == 1 and "not valid JSON" in err


def test_cli_unknown_id_is_not_found(db):
    code, _, err = run("ruleset", "show", "nope")
    assert code == 1 and "not-found" in err


def test_cli_rule_add_takes_a_deny_rule_and_refuses_an_unknown_action(api, monkeypatch):
    rs = api.post("/api/v1/rulesets", {"name": "block", "scope": ""}, format="json").json()
    body = {"action": "deny", "sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 23}]}
    code, out, _ = run(
        "rule", "add", rs["id"], "-", "--json", stdin_text=json.dumps(body), monkeypatch=monkeypatch
    )
    assert code == 0 and json.loads(out)["action"] == "deny"
    code, _, err = run(
        "rule",
        "add",
        rs["id"],
        "-",
        stdin_text=json.dumps({**body, "action": "reject"}),
        monkeypatch=monkeypatch,
    )
    assert code == 2 and err.strip().splitlines() == [
        "error: /action: action must be one of allow, deny, not 'reject'. [action]"
    ]

"""A policy file is read by YAML 1.2's core schema (flows/policy_drafts/as_code/yaml_core.py), not by
PyYAML's YAML 1.1 rules: each scalar reads as YAML 1.2 reads it, or the file is refused with one line
naming the place. Integers are bounded, and the file by its bytes and its rules."""

from __future__ import annotations

import json
import math

import pytest

from controlplane.problems import Problem
from flows.policy_drafts.as_code import parse
from flows.policy_drafts.as_code.format import MAX_FILE_BYTES, policy_file_load
from tests.support.helpers import run_command as run

# (plain scalar, what YAML 1.2's core schema reads)
READ_AS_YAML_1_2 = [
    ("1:30", "1:30"),  # YAML 1.1: 90 (base 60)
    ("12:00:00", "12:00:00"),  # YAML 1.1: 43200
    ("017", 17),  # YAML 1.1: 15 (octal)
    ("0o17", 15),
    ("0x1F", 31),
    ("+12", 12),
    ("1_000", "1_000"),  # YAML 1.1: 1000
    ("0b101", "0b101"),  # YAML 1.1: 5
    ("yes", "yes"),  # YAML 1.1: true
    ("no", "no"),
    ("on", "on"),
    ("Off", "Off"),
    ("y", "y"),
    ("true", True),
    ("FALSE", False),
    ("tRue", "tRue"),
    ("2026-01-01", "2026-01-01"),  # YAML 1.1: a date
    ("2026-01-01T00:00:00Z", "2026-01-01T00:00:00Z"),
    ("~", None),
    ("Null", None),
    ("1.5", 1.5),
    ("1e3", 1000.0),
    ("-.INF", -math.inf),
    ("'17'", "17"),
    ("!!str 17", "17"),
    ("!!int '42'", 42),
]


@pytest.mark.parametrize(("scalar", "expected"), READ_AS_YAML_1_2, ids=[case[0] for case in READ_AS_YAML_1_2])
def test_a_scalar_reads_as_yaml_1_2_reads_it(scalar, expected):
    assert policy_file_load(text=f"value: {scalar}\n", source="p.yaml") == {"value": expected}


REFUSED = [
    ("value: " + "9" * 5000, "line 1 column 8: an integer of 5000 digits: no field takes more than 40"),
    ("value: -" + "1" * 41, "an integer of 41 digits"),
    (
        "value: !!python/object:os.system x",
        "line 1 column 8: the tag !!python/object:os.system is not admitted",
    ),
    ("value: !!python/name:os.system ''", "the tag !!python/name:os.system is not admitted"),
    ("value: !!timestamp 2026-01-01", "the tag !!timestamp is not admitted"),
    ("value: !!binary aGk=", "the tag !!binary is not admitted"),
    ("value: !!set {a: null}", "the tag !!set is not admitted"),
    ("value: !!int 1_000", "'1_000' is not an integer"),
    ("value: !!bool yes", "'yes' is not a boolean (true or false)"),
    ("a: &x [1]\nb: *x\n", "aliases (*name) are not admitted"),
]


@pytest.mark.parametrize(("text", "message"), REFUSED, ids=[case[0][:40] for case in REFUSED])
def test_what_yaml_1_2_does_not_read_is_refused_with_one_line_naming_the_place(db, tmp_path, text, message):
    with pytest.raises(Problem) as refused:
        policy_file_load(text=text, source="p.yaml")
    assert message in refused.value.detail and "\n" not in refused.value.detail
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    code, _, err = run("policy", "plan", str(path))
    assert code == 1 and len(err.strip().splitlines()) == 1 and message in err and "malformed-request" in err


def _service_file(port_text: str) -> str:
    return (
        "version: 1\naddress_groups: []\nrulesets: []\n"
        f"services:\n  - name: ssh\n    entries:\n      - protocol: tcp\n        port: {port_text}\n"
    )


@pytest.mark.parametrize(
    ("port_text", "rule"),
    [("1:30", "type"), ("1_000", "type"), ("yes", "type"), ("2026-01-01", "type"), ("22.0", "type"),
     ("0x10000", "out-of-range"), ("99999999999999999999", "out-of-range")],
)  # fmt: skip
def test_a_port_that_yaml_1_1_would_make_a_number_is_refused_as_a_port(db, tmp_path, port_text, rule):
    path = tmp_path / "policy.yaml"
    path.write_text(_service_file(port_text))
    code, _, err = run("policy", "plan", str(path))
    assert code == 2 and "error: services[0].entries[0].port: " in err and f"[{rule}]" in err


@pytest.mark.parametrize(("port_text", "port"), [("0x16", 22), ("0o26", 22), ("022", 22)])
def test_a_port_in_a_yaml_1_2_integer_form_is_that_port(db, tmp_path, port_text, port):
    path = tmp_path / "policy.yaml"
    path.write_text(_service_file(port_text))
    code, out, err = run("policy", "plan", str(path), "--json")
    assert code == 0, err
    (change,) = json.loads(out)["changes"]
    assert {"field": "entries", "action": "set", "new": [{"protocol": "tcp", "port": port}]} in change[
        "fields"
    ]


def test_a_file_over_its_bytes_is_refused_before_it_is_read():
    with pytest.raises(Problem) as refused:
        policy_file_load(text="#" * (MAX_FILE_BYTES + 1), source="p.yaml")
    assert "larger than 4 MiB" in refused.value.detail


def test_a_file_of_more_rules_than_a_file_holds_is_one_finding(db, tmp_path, monkeypatch):
    """The rules of every ruleset together; at the bound the file is planned."""
    monkeypatch.setattr(parse, "MAX_FILE_RULES", 3)
    rule = {"sources": [{"any": True}], "services": [{"protocol": "icmp"}]}
    data = {
        "version": 1,
        "services": [],
        "address_groups": [],
        "rulesets": [
            {"name": "a", "scope": "", "rules": [rule, rule]},
            {"name": "b", "scope": "", "rules": [rule]},
        ],
    }
    path = tmp_path / "policy.yaml"
    path.write_text(json.dumps(data))
    code, _, err = run("policy", "plan", str(path))
    assert code == 0, err
    data["rulesets"][1]["rules"].append(rule)
    path.write_text(json.dumps(data))
    code, _, err = run("policy", "plan", str(path))
    assert code == 2
    assert (
        err.strip()
        == "error: rulesets: A policy file holds at most 3 rules in all; this one has 4. [too-many]"
    )

"""The example alerting rules (deploy/prometheus/alerts.yml): promtool accepts them, its unit tests
(alerts.test.yml) see each alert fire when it should and not before, and every metric they name is
one serve exposes and docs/metrics.md documents."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.support.prometheus import check_rules, rule_tests_pass

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "alerts.yml"


def test_promtool_checks_the_rules():
    assert "SUCCESS: 10 rules found" in check_rules(RULES)


def test_each_alert_fires_as_its_unit_test_says():
    rule_tests_pass(RULES.with_name("alerts.test.yml"))


def _named_in_rules() -> set[str]:
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    return {name for rule in rules for name in re.findall(r"\bpalisade_[a-z_]+", rule["expr"])}


def test_the_rules_name_metrics_serve_exposes_and_the_docs_describe(api, db):
    exposition = api.get("/metrics").content.decode()
    exposed = set(re.findall(r"^# TYPE (\S+) ", exposition, re.MULTILINE))
    exposed |= {f"{name}_total" for name in exposed}  # a counter's samples carry _total
    named = _named_in_rules()
    assert named and named <= exposed, named - exposed
    documented = (REPO / "docs" / "metrics.md").read_text()
    assert not [name for name in named if f"`{name}`" not in documented]


def test_every_metric_serve_exposes_is_documented(api, db):
    exposition = api.get("/metrics").content.decode()
    names = set(re.findall(r"^# TYPE (palisade_\S+) ", exposition, re.MULTILINE))
    assert len(names) > 25
    documented = (REPO / "docs" / "metrics.md").read_text()
    assert sorted(name for name in names if f"`{name}`" not in documented) == []

"""The docs name every problem type and every validation rule the code can produce."""

import re
from pathlib import Path

from controlplane.problems import PROBLEM_TYPES

ROOT = Path(__file__).resolve().parent.parent
API_DOC = (ROOT / "docs" / "api.md").read_text()
RULE_USE = re.compile(
    r'(?:\.add|Finding)\((?:f?"[^"]*"|[^()"]|\([^()]*\)){0,80}?,\s*"([a-z][a-z0-9-]+)"', re.S
)
GRAMMAR_RULE = re.compile(r'GrammarError\(\s*"([a-z][a-z0-9-]+)"')


def test_every_problem_type_is_documented():
    for name in PROBLEM_TYPES:
        assert f"| `{name}` |" in API_DOC, name


def test_every_validation_rule_is_documented():
    used = set()
    for package in ("controlplane", "policy", "fleet", "flows"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            used |= set(RULE_USE.findall(text)) | set(GRAMMAR_RULE.findall(text))
    assert {"unknown-field", "selector-syntax", "port-not-allowed", "unknown-reference"} <= used
    documented = set(re.findall(r"`([a-z][a-z0-9-]+)`", API_DOC.split("## Validation findings")[1]))
    assert sorted(used - documented) == []

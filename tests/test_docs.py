"""The docs name every problem type and every validation rule the code can produce, and give the
gateway's close codes."""

import re
from pathlib import Path

from agent import protocol
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


def test_the_protocol_doc_gives_the_close_codes_the_gateway_sends():
    """A renew-only stream's other messages close with 4001 in every step that says so (4403 makes the
    agent give up and ask for a re-enrolment); a credential beyond its grace with 4403."""
    doc = re.sub(r"\s+", " ", (ROOT / "docs" / "protocol.md").read_text())
    renew_only = re.findall(
        r"only message accepted is `renew`; anything else closes the stream with (\d{4})", doc
    )
    renew_only += re.findall(r"Any message but `renew` on a renew-only stream closes with (\d{4})", doc)
    assert renew_only and set(renew_only) == {str(protocol.CLOSE_UNEXPECTED)}
    beyond = re.findall(r"expired beyond its grace: close (\d{4})", doc)
    beyond += re.findall(r"renewal beyond the grace closes the stream with (\d{4})", doc)
    assert len(beyond) == 2 and set(beyond) == {str(protocol.CLOSE_FORBIDDEN)}

"""A range and a selection are parsed by one function (flows/validation.py `flow_selection_parse`) for every
endpoint and command that takes them: the same bad input gets the same finding rule, at its parameter,
from the rollup, the gaps and the review (query parameters, `manage.py flows`) and from the impact and
the suggestions (JSON bodies, `manage.py policy`)."""

from __future__ import annotations

import json
import re
import uuid

import pytest

from tests.support.helpers import run_command as run

FROM, TO = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"
UNKNOWN = str(uuid.uuid4())

# (case, from, to, labels, workloads, what every endpoint must answer: {parameter: rule}, or a problem type)
CASES = [
    ("malformed from", "yesterday", TO, [], [], {"from": "instant"}),
    ("a number as from", "5", TO, [], [], {"from": "instant"}),
    ("before 1970", "1960-01-01T00:00:00Z", TO, [], [], {"from": "out-of-range"}),
    ("to before from", TO, FROM, [], [], {"to": "out-of-range"}),
    ("over 31 days", FROM, "2026-03-01T00:00:00Z", [], [], {"to": "out-of-range"}),
    ("bad selector", FROM, TO, ["app=web", "app in ()"], [], {"label/1": "selector-empty-set"}),
    (
        "bad range and selector together",
        "yesterday",
        FROM,
        ["a b"],
        [],
        {"from": "instant", "label/0": "selector-syntax"},
    ),
    ("unknown workload", FROM, TO, [], [UNKNOWN], "not-found"),
]


def _findings(document: dict) -> dict[str, str] | str:
    """A problem document as {parameter: rule} (`?label[1]` and `/label/1` both as `label/1`), or its type."""
    name = document["type"].rsplit(":", 1)[-1]
    if name != "validation":
        return name
    out = {}
    for error in document["errors"]:
        path = re.sub(r"\[(\d+)\]$", r"/\1", error["path"].lstrip("?/"))
        out[path] = error["rule"]
    return out


def _api_get(api, path: str, start, end, labels, workloads) -> dict | str:
    params = {"from": start, "to": end, "label": labels, "workload": workloads, "group_by": ["peer"]}
    params = {name: value for name, value in params.items() if value is not None}
    response = api.get(f"/api/v1/{path}", params)
    assert response.status_code in (404, 422), response.content
    return _findings(response.json())


def _api_post(api, path: str, body: dict) -> dict | str:
    response = api.post(f"/api/v1/{path}", body, format="json")
    assert response.status_code in (404, 422), response.content
    return _findings(response.json())


def _cli(*args) -> dict | str:
    code, out, _ = run(*args, "--json")
    assert code in (1, 2), out
    return _findings(json.loads(out))


def _selection_args(start, end, labels, workloads) -> list[str]:
    args = ["--from", start, "--to", end]
    for label in labels:
        args += ["--label", label]
    for workload in workloads:
        args += ["--workload", workload]
    return args


@pytest.mark.parametrize(
    ("start", "end", "labels", "workloads", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_every_endpoint_and_command_gives_the_same_rule(
    api, db, tmp_path, start, end, labels, workloads, expected
):
    body = {"from": start, "to": end, "label": labels, "workload": workloads}
    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps({"rulesets": []}))
    selection = _selection_args(start, end, labels, workloads)
    answers = {
        "GET /flows/rollup": _api_get(api, "flows/rollup", start, end, labels, workloads),
        "GET /flows/gaps": _api_get(api, "flows/gaps", start, end, labels, workloads),
        "GET /flows/review": _api_get(api, "flows/review", start, end, labels, workloads),
        "POST /policies/impact": _api_post(api, "policies/impact", {"rulesets": [], **body}),
        "POST /policies/suggestions": _api_post(api, "policies/suggestions", body),
        "flows rollup": _cli("flows", "rollup", "--group-by", "peer", *selection),
        "flows gaps": _cli("flows", "gaps", *selection),
        "flows review": _cli("flows", "review", *selection),
        "policy impact": _cli("policy", "impact", str(draft), *selection),
        "policy suggest": _cli("policy", "suggest", *selection),
    }
    assert answers == dict.fromkeys(answers, expected)


@pytest.mark.parametrize("value", [5, 5.5, True, {"at": FROM}, [FROM]])
def test_a_body_whose_from_is_no_string_is_a_malformed_instant_on_both_endpoints(api, db, value):
    """A JSON body can give what a query parameter cannot: a `from` that is not a string is refused as
    a malformed instant (as its text would be in a query), not as a missing one."""
    body = {"from": value, "to": TO}
    assert _api_post(api, "policies/impact", {"rulesets": [], **body}) == {"from": "instant"}
    assert _api_post(api, "policies/suggestions", body) == {"from": "instant"}


def test_a_missing_range_is_required_on_every_endpoint(api, db):
    """The commands require --from and --to themselves; the endpoints name both."""
    expected = {"from": "required", "to": "required"}
    assert _api_get(api, "flows/rollup", None, None, [], []) == expected
    assert _api_get(api, "flows/gaps", None, None, [], []) == expected
    assert _api_get(api, "flows/review", None, None, [], []) == expected
    assert _api_post(api, "policies/impact", {"rulesets": []}) == expected
    assert _api_post(api, "policies/suggestions", {}) == expected

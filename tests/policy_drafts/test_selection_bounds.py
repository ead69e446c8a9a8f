"""A selection is bounded where it is parsed (flows/validation.py `flow_selection_parse`), so every
endpoint and command that takes one refuses the same input with the same finding, at the same
parameter: at most 64 selectors, at most 1,000 distinct workload ids (repeats count once), at most 16
`label_keys`; a label key or value outside the grammar's ASCII (a look-alike letter) is refused."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from flows.validation import MAX_LABEL_KEYS, MAX_SELECTION_REQUIREMENTS, MAX_SELECTORS, MAX_WORKLOAD_IDS
from policy.grammar import parse_selector
from tests.policy_drafts.test_same_selection_findings import _api_get, _api_post, _cli, _selection_args
from tests.support.workloads import make_workload

FROM, TO = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"
# A selector of the most requirements it may have (64).
WIDE = ",".join(f"k{i}=v" for i in range(64))
# Selectors of every operator, as many requirements in all as a selection may hold (256).
MIXED = [
    ",".join(f"k{i} {op} (v,w)" if op in ("in", "notin") else f"{'!' if op == '!' else ''}k{i}{op if op not in ('!', '') else ''}{'v' if op in ('=', '!=') else ''}"
             for i in range(64))
    for op in ("in", "notin", "!=", "!")
]  # fmt: skip

CASES = [
    ("65 selectors", ["app=web"] * (MAX_SELECTORS + 1), [], {"label": "too-many"}),
    ("257 requirements in all", [*MIXED, "app=web"], [], {"label": "too-many"}),
    ("200 selectors of 64 requirements", [WIDE] * 200, [], {"label": "too-many"}),
    ("5 selectors of 64 requirements", [WIDE] * 5, [], {"label": "too-many"}),
    (
        "1,001 distinct workload ids",
        [],
        [str(uuid.UUID(int=i + 1)) for i in range(MAX_WORKLOAD_IDS + 1)],
        {"workload": "too-many"},
    ),
    (
        "a selector nested deeply",
        ["app in " + "(" * 5000 + "a" + ")" * 5000],
        [],
        {"label/0": "selector-too-long"},
    ),
    ("a Cyrillic letter in a label value", ["app=w\u0435b"], [], {"label/0": "label-value"}),
    ("a full-width letter in a label key", ["\uff41pp=web"], [], {"label/0": "label-key"}),
    ("a zero-width space in a label value", ["app=we\u200bb"], [], {"label/0": "label-value"}),
]


@pytest.mark.parametrize(
    ("labels", "workloads", "expected"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_a_selection_past_its_bounds_is_refused_alike_everywhere(
    api, db, tmp_path, labels, workloads, expected
):
    body = {"from": FROM, "to": TO, "label": labels, "workload": workloads}
    draft = tmp_path / "draft.json"
    draft.write_text('{"rulesets": []}')
    selection = _selection_args(FROM, TO, labels, workloads)
    answers = {
        "GET /flows/rollup": _api_get(api, "flows/rollup", FROM, TO, labels, workloads),
        "GET /flows/gaps": _api_get(api, "flows/gaps", FROM, TO, labels, workloads),
        "GET /flows/review": _api_get(api, "flows/review", FROM, TO, labels, workloads),
        "POST /policies/impact": _api_post(api, "policies/impact", {"rulesets": [], **body}),
        "POST /policies/suggestions": _api_post(api, "policies/suggestions", body),
        "flows rollup": _cli("flows", "rollup", "--group-by", "peer", *selection),
        "flows gaps": _cli("flows", "gaps", *selection),
        "flows review": _cli("flows", "review", *selection),
        "policy impact": _cli("policy", "impact", str(draft), *selection),
        "policy suggest": _cli("policy", "suggest", *selection),
    }
    assert answers == dict.fromkeys(answers, expected)


def test_more_than_16_label_keys_are_refused_alike_by_the_endpoint_and_the_command(api, db):
    keys = [f"k{i}" for i in range(MAX_LABEL_KEYS + 1)]
    body = {"from": FROM, "to": TO, "label_keys": keys}
    args = [arg for key in keys for arg in ("--label-key", key)]
    expected = {"label_keys": "too-many"}
    assert _api_post(api, "policies/suggestions", body) == expected
    assert _cli("policy", "suggest", "--from", FROM, "--to", TO, *args) == expected


def test_the_widest_selection_the_bounds_admit_is_answered(api, db):
    """16 label keys and 256 requirements of every operator in all (four selectors of 64): a query
    the database answers, SQLite's too (200 selectors of 64 requirements were a 500)."""
    make_workload(labels={f"k{i}": "v" for i in range(64)})
    assert sum(len(parse_selector(text).requirements) for text in MIXED) == MAX_SELECTION_REQUIREMENTS
    keys = [f"k{i}" for i in range(MAX_LABEL_KEYS)]
    body = {"from": FROM, "to": TO, "label": MIXED, "label_keys": keys}
    response = api.post("/api/v1/policies/suggestions", body, format="json")
    assert response.status_code == 200, response.content
    query = {"from": FROM, "to": TO, "label": MIXED, "group_by": "peer"}
    assert api.get("/api/v1/flows/rollup", query).status_code == 200


def test_repeated_workload_ids_count_once_and_are_resolved_in_one_query(api, db):
    """26,000 copies of one id took 51 s: each was looked up on its own. Repeats (however the UUID is
    written) are one id now, and the ids are resolved together."""
    workload = make_workload()
    copies = [str(workload.id), str(workload.id).upper(), "{" + str(workload.id) + "}"] * 5000
    body = {"from": FROM, "to": TO, "workload": copies}
    with CaptureQueriesContext(connection) as queries:
        response = api.post("/api/v1/policies/suggestions", body, format="json")
    assert response.status_code == 200, response.content
    assert len(queries.captured_queries) < 40
    assert response.json()["coverage"]["workloads_without_reports"] == [str(workload.id)]


def test_an_unknown_workload_among_known_ones_is_not_found(api, db):
    known = make_workload()
    unknown = str(uuid.uuid4())
    response = api.post(
        "/api/v1/policies/suggestions",
        {"from": FROM, "to": TO, "workload": [str(known.id), unknown]},
        format="json",
    )
    assert response.status_code == 404 and unknown in response.json()["detail"]


def test_a_query_of_more_parameters_than_any_selection_needs_is_a_malformed_request(api, db):
    """Past the parameters the largest selection needs, the query is refused before it is parsed,
    as a problem (it was a 500)."""
    response = api.get(
        "/api/v1/flows/rollup", {"from": FROM, "to": TO, "group_by": "peer", "workload": ["x"] * 2001}
    )
    assert response.status_code == 400
    assert response.json()["type"].endswith("malformed-request") and "2,000" in response.json()["detail"]

"""The heavy reads stop at their row bound and say what they left out: the impact and the suggestions
read at most KEYS_READ flow keys (those of most connections first, the windows' aggregate keys left
out in the query), `manage.py flows rollup` at most ROLLUP_ROWS rows; each answer says it is
truncated, how many keys or rows it left out and their connections. The bounds are made small here:
what is tested is that the read stops there and counts the rest, not the figure."""

from __future__ import annotations

import itertools
import json
from datetime import timedelta

import pytest

from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from fleet.services import workload_labels_replace
from flows import selectors
from flows.choices import AGGREGATE
from flows.services import flow_report_ingest
from tests.support.flow_evidence import enrolled, flow_report, windows_between
from tests.support.helpers import run_command

_uptimes = itertools.count(100)
# Outside peers of the server's tcp/22, by connections a minute: the bound keeps the first ones.
PEERS = {"198.51.100.1": 9, "198.51.100.2": 7, "198.51.100.3": 5, "198.51.100.4": 3, "198.51.100.5": 1}
MINUTES = 20
AGGREGATED = 1000  # the aggregate key's connections a minute: more than any key, and never read


@pytest.fixture
def server(db):
    workload, _, _ = enrolled("db1", "10.50.0.10")
    workload = workload_labels_replace(
        actor=CLI_ACTOR, workload_id=str(workload.id), expected_version=str(workload.labels_version),
        data={"labels": {"app": "db"}},
    )  # fmt: skip
    windows = windows_between(clock.now() - timedelta(minutes=30), MINUTES)
    for window in windows:
        template = window["groups"][0]
        window["groups"] = [
            *({**template, "peer": peer, "port": 22, "connection_count": n} for peer, n in PEERS.items()),
            {**template, "peer": AGGREGATE, "protocol": AGGREGATE, "port": 0, "rule": None,
             "connection_count": AGGREGATED},
        ]  # fmt: skip
    answer = flow_report_ingest(workload_id=str(workload.id), data=flow_report("p1", next(_uptimes), windows))
    assert all(r["result"] == "accepted" for r in answer["windows"]), answer
    return workload


def _range(back: int, until: int) -> dict:
    """From `back` minutes to `until` minutes before the current minute."""
    now = clock.now().replace(second=0, microsecond=0)
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    return {"from": text(now - timedelta(minutes=back)), "to": text(now - timedelta(minutes=until))}


# The fixture's windows start 29 minutes before the current minute, one a minute for 20 minutes. A
# range of minute rows alone (8 minutes: never a whole ten-minute block) and one that holds whole
# blocks (read through the sums' plan): (back, until, the fixture's windows inside). Both reads bound
# and count the keys in SQL.
RANGES = {"minute rows": (18, 10, 8), "whole blocks": (60, -1, MINUTES)}


def _left_out(kept: int, windows: int) -> dict:
    """What the answer must say when `kept` keys of PEERS are read: the rest of the keys, and their
    connections in the range's windows (the aggregate key neither read nor counted)."""
    rest = list(PEERS.values())[kept:]
    return {
        "keys_total": len(PEERS),
        "keys_left_out": len(PEERS) - kept,
        "connections_left_out": sum(rest) * windows,
    }


@pytest.mark.parametrize(("back", "until", "windows"), RANGES.values(), ids=RANGES.keys())
def test_suggestions_past_their_key_bound_say_they_are_truncated_and_what_they_left_out(
    api, server, monkeypatch, back, until, windows
):
    monkeypatch.setattr(selectors, "KEYS_READ", 2)
    body = {**_range(back, until), "label": ["app=db"]}
    answer = api.post("/api/v1/policies/suggestions", body, format="json").json()
    assert answer["truncated"] is True
    assert {k: answer[k] for k in ("keys_total", "keys_left_out", "connections_left_out")} == _left_out(
        2, windows
    )
    # The two keys of most connections are what the proposal learnt from; the aggregate key is none.
    assert answer["address_groups"][0]["members"] == ["198.51.100.1", "198.51.100.2"]
    code, out, _ = run_command(
        "policy", "suggest", "--from", body["from"], "--to", body["to"], "--label", "app=db", "--answer"
    )
    assert code == 0 and json.loads(out)["truncated"] is True
    assert json.loads(out)["keys_left_out"] == 3


def test_suggestions_within_their_key_bound_are_not_truncated(api, server):
    body = {**_range(60, -1), "label": ["app=db"]}
    answer = api.post("/api/v1/policies/suggestions", body, format="json").json()
    assert answer["truncated"] is False
    assert {k: answer[k] for k in ("keys_total", "keys_left_out", "connections_left_out")} == _left_out(
        5, MINUTES
    )
    assert AGGREGATE not in answer["address_groups"][0]["members"]


@pytest.mark.parametrize(("back", "until", "windows"), RANGES.values(), ids=RANGES.keys())
def test_the_impact_past_its_key_bound_says_it_is_truncated_and_what_it_left_out(
    api, server, monkeypatch, tmp_path, back, until, windows
):
    monkeypatch.setattr(selectors, "KEYS_READ", 3)
    # A draft that admits tcp/22 from anywhere to the server: every key read is newly admitted.
    draft = {
        "rulesets": [
            {"name": "ssh", "scope": "app=db", "rules": [{"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 22}]}]}
        ]
    }  # fmt: skip
    answer = api.post("/api/v1/policies/impact", {**draft, **_range(back, until)}, format="json").json()
    assert answer["truncated"] is True and answer["keys_classified"] == 3
    assert {k: answer[k] for k in ("keys_total", "keys_left_out", "connections_left_out")} == _left_out(
        3, windows
    )
    assert [e["peer"] for e in answer["newly_admitted"]] == list(PEERS)[:3]
    path = tmp_path / "draft.json"
    path.write_text(json.dumps(draft))
    selection = _range(back, until)
    code, out, _ = run_command(
        "policy", "impact", str(path), "--from", selection["from"], "--to", selection["to"], "--json"
    )
    assert code == 0 and json.loads(out)["keys_left_out"] == 2 and json.loads(out)["truncated"] is True
    code, out, _ = run_command(
        "policy", "impact", str(path), "--from", selection["from"], "--to", selection["to"]
    )
    assert "TRUNCATED: 2 flow keys of fewest connections not judged" in out


@pytest.mark.parametrize(("back", "until", "windows"), RANGES.values(), ids=RANGES.keys())
def test_the_rollup_command_past_its_row_bound_says_it_is_truncated_and_how_many_rows_it_left_out(
    server, monkeypatch, back, until, windows
):
    monkeypatch.setattr(selectors, "ROLLUP_ROWS", 2)
    selection = _range(back, until)
    args = ("flows", "rollup", "--group-by", "peer", "--from", selection["from"], "--to", selection["to"])
    code, out, _ = run_command(*args, "--json")
    document = json.loads(out)
    # Six peers, in key order: the aggregate key `*` (the rollup shows it: it is evidence of the range)
    # and the five.
    assert code == 0 and document["truncated"] is True and document["rows_left_out"] == 4
    assert [row["peer"] for row in document["items"]] == [AGGREGATE, "198.51.100.1"]
    code, out, _ = run_command(*args)
    assert code == 0 and "truncated: 4 more rows not shown" in out


def test_a_page_of_the_rollup_reads_only_its_rows_and_pages_on_past_the_bound(api, server, monkeypatch):
    """The API's pages are bounded by their limit and continue by cursor: the bound of one document
    does not apply to them, and each page's rows are chosen in the statement."""
    monkeypatch.setattr(selectors, "ROLLUP_ROWS", 2)
    peers, cursor = [], None
    while True:
        query = {**_range(60, -1), "group_by": "peer", "limit": 2, **({"cursor": cursor} if cursor else {})}
        page = api.get("/api/v1/flows/rollup", query).json()
        peers += [row["peer"] for row in page["items"]]
        if not (cursor := page["next_cursor"]):
            break
    assert peers == [AGGREGATE, *PEERS]


def test_a_plans_impact_past_the_key_bound_says_what_it_left_out(server, monkeypatch, tmp_path):
    monkeypatch.setattr(selectors, "KEYS_READ", 2)
    rule = {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 22}]}
    data = {
        "version": 1,
        "services": [],
        "address_groups": [],
        "rulesets": [{"name": "ssh", "scope": "app=db", "rules": [rule]}],
    }
    path = tmp_path / "policy.yaml"
    path.write_text(json.dumps(data))
    code, out, _ = run_command("policy", "plan", str(path), "--json")
    impact = json.loads(out)["impact"]
    assert code == 0
    assert {k: impact[k] for k in ("keys_total", "keys_left_out", "connections_left_out")} == _left_out(
        2, MINUTES
    )
    code, out, _ = run_command("policy", "plan", str(path))
    assert "TRUNCATED: 3 flow keys of fewest connections not judged" in out

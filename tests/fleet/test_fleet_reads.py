"""Fleet order, filters and stable paging; labels with If-Match; rendered policy."""

import pytest

from fleet import sync
from tests.support.helpers import assert_problem
from tests.support.workloads import connect, make_workload


def walk(api, query=""):
    ids, cursor = [], None
    while True:
        url = f"/api/v1/workloads?limit=2{query}" + (f"&cursor={cursor}" if cursor else "")
        body = api.get(url).json()
        ids += [w["hostname"] for w in body["items"]]
        if not (cursor := body["next_cursor"]):
            return ids


def test_fleet_order_attention_offline_pending_synced_then_host_name(api, db):
    synced = connect(make_workload(hostname="e-synced"))
    sync.workload_applied(workload_id=synced.id, stream_id="stream-1", version=synced.latest_policy_id)
    connect(make_workload(hostname="d-pending"))
    make_workload(hostname="c-offline")
    degraded = connect(make_workload(hostname="z-degraded"))
    sync.workload_apply_failed(
        workload_id=degraded.id, stream_id="stream-1", version=degraded.latest_policy_id, error="e"
    )
    removed = connect(make_workload(hostname="y-removed"))
    sync.workload_table_reported(workload_id=removed.id, stream_id="stream-1", state="absent")
    assert walk(api) == ["y-removed", "z-degraded", "c-offline", "d-pending", "e-synced"]


def test_paging_is_stable_while_workloads_are_enrolled(api, db):
    for name in ("b", "d", "f", "h"):
        make_workload(hostname=name)
    first = api.get("/api/v1/workloads?limit=2").json()
    assert [w["hostname"] for w in first["items"]] == ["b", "d"]
    make_workload(hostname="a")  # sorts before the cursor: not seen on this walk, nothing repeats
    make_workload(hostname="e")  # sorts after it: seen once
    rest = api.get(f"/api/v1/workloads?limit=10&cursor={first['next_cursor']}").json()
    assert [w["hostname"] for w in rest["items"]] == ["e", "f", "h"]


@pytest.mark.parametrize(
    "labels, expected",
    [
        (["env=prod"], ["a", "b"]),
        (["env=prod", "app=web"], ["a"]),
        (["env in (prod,dev)", "app!=web"], ["b", "c"]),
        (["tier"], ["c"]),
        (["!tier"], ["a", "b", "d"]),
        (["env notin (prod)"], ["c", "d"]),
        (["example.com/owner=team-1"], ["d"]),
    ],
)
def test_label_filters_use_the_selector_grammar_anded(api, db, labels, expected):
    make_workload(hostname="a", labels={"env": "prod", "app": "web"})
    make_workload(hostname="b", labels={"env": "prod", "app": "db"})
    make_workload(hostname="c", labels={"env": "dev", "tier": "1"})
    make_workload(hostname="d", labels={"example.com/owner": "team-1"})
    query = "".join(f"&label={label}" for label in labels)
    assert walk(api, query) == expected


def test_bad_filters_are_validation_problems(api, db):
    body = assert_problem(api.get("/api/v1/workloads?label=env in (prod"), 422, "validation")
    assert body["errors"][0]["path"] == "?label[0]" and "position" in body["errors"][0]["message"]
    assert_problem(api.get("/api/v1/workloads?sync_state=happy"), 422, "validation")
    assert_problem(api.get("/api/v1/workloads?removed=maybe"), 422, "validation")


def test_the_id_filter_lists_only_those_workloads_anded_with_the_others(api, db):
    wanted = [make_workload(hostname=f"w-{index}", labels={"env": "prod"}) for index in range(3)]
    other = make_workload(hostname="w-other", labels={"env": "dev"})
    query = "".join(f"&id={w.id}" for w in wanted[:2] + [other])
    assert walk(api, query) == ["w-0", "w-1", "w-other"]
    assert walk(api, query + "&label=env=prod") == ["w-0", "w-1"]
    absent = "00000000-0000-4000-8000-000000000000"
    assert walk(api, f"&id={absent}&id={wanted[2].id}") == ["w-2"]  # no such workload: not listed
    body = assert_problem(api.get(f"/api/v1/workloads?id={wanted[0].id}&id=nope"), 422, "validation")
    assert body["errors"][0]["path"] == "?id[1]" and "not a workload id" in body["errors"][0]["message"]


def test_cursor_from_other_filters_is_stale(api, db):
    for name in "abc":
        make_workload(hostname=name, labels={"env": "prod"})
    cursor = api.get("/api/v1/workloads?limit=1").json()["next_cursor"]
    body = assert_problem(
        api.get(f"/api/v1/workloads?limit=1&label=env=prod&cursor={cursor}"), 422, "validation"
    )
    assert body["errors"][0]["rule"] == "cursor-stale"


def test_workload_and_rendered_policy_reads(api, db):
    workload = make_workload(hostname="web-1", labels={"app": "web"})
    body = api.get(f"/api/v1/workloads/{workload.id}").json()
    assert set(body) == {
        "id",
        "hostname",
        "addresses",
        "labels",
        "labels_version",
        "mode",
        "mode_since",
        "outbound_mode",
        "outbound_mode_since",
        "latest_version",
        "applied_version",
        "agent_version",
        "sync",
        "health",
        "enrolled_at",
    }
    assert set(body["health"]["credential"]) == {
        "state",
        "expires_at",
        "renewal_due_at",
        "last_error",
        "last_late_renewal",
        "last_late_renewal_late_by_seconds",
        "revoked",
    }
    assert body["health"]["credential"]["revoked"] is None
    policy = api.get(f"/api/v1/workloads/{workload.id}/rendered-policy").json()
    assert policy["version"] == body["latest_version"]
    assert policy["document"].startswith("table inet palisade {")
    assert_problem(api.get("/api/v1/workloads/nope"), 404, "not-found")
    assert_problem(api.get("/api/v1/workloads/nope/rendered-policy"), 404, "not-found")


def test_labels_read_and_replace_with_if_match(api, db):
    workload = make_workload(labels={"app": "web"})
    path = f"/api/v1/workloads/{workload.id}/labels"
    got = api.get(path)
    assert got.json() == {"labels": {"app": "web"}, "version": "1"} and got["ETag"] == '"1"'
    assert_problem(api.put(path, {"labels": {"app": "db"}}, format="json"), 428, "precondition-required")
    body = assert_problem(
        api.put(path, {"labels": {"app": "db"}}, format="json", HTTP_IF_MATCH='"7"'),
        412,
        "precondition-failed",
    )
    assert body["current_version"] == "1"
    response = api.put(path, {"labels": {"app": "db", "env": "prod"}}, format="json", HTTP_IF_MATCH='"1"')
    assert response.status_code == 200 and response.json() == {
        "labels": {"app": "db", "env": "prod"},
        "version": "2",
    }
    assert response["ETag"] == '"2"'


@pytest.mark.parametrize(
    "labels, path, rule",
    [
        ({"Bad Key": "x"}, "/labels/Bad Key", "label-key"),
        ({"app": "not valid!"}, "/labels/app", "label-value"),
        ({"app": 5}, "/labels/app", "label-value"),
        ("app=web", "/labels", "labels-type"),
    ],
)
def test_label_findings(api, db, labels, path, rule):
    workload = make_workload()
    body = assert_problem(
        api.put(
            f"/api/v1/workloads/{workload.id}/labels", {"labels": labels}, format="json", HTTP_IF_MATCH='"1"'
        ),
        422,
        "validation",
    )
    assert (body["errors"][0]["path"], body["errors"][0]["rule"]) == (path, rule)

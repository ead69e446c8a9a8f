"""Rendering fan-out: exactly the affected workloads are re-rendered and written; streams are told."""

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from fleet.models import ModeChange, Workload
from fleet.push import stream_group
from tests.support.helpers import assert_problem
from tests.support.workloads import connect, make_workload


def versions():
    return dict(Workload.objects.values_list("hostname", "latest_policy_id"))


def client_rule_ruleset(api):
    return api.post(
        "/api/v1/rulesets",
        {
            "name": "web",
            "scope": "app=web",
            "rules": [
                {"sources": [{"selector": "role=client"}], "services": [{"protocol": "tcp", "port": 443}]}
            ],
        },
        format="json",
    ).json()


def test_policy_write_rerenders_exactly_the_scope(api, db):
    make_workload(hostname="web", labels={"app": "web"}, mode="enforced")
    make_workload(hostname="db", labels={"app": "db"}, mode="enforced")
    make_workload(hostname="client", labels={"role": "client"}, mode="enforced")
    before = versions()
    client_rule_ruleset(api)
    after = versions()
    assert after["web"] != before["web"]
    assert after["db"] == before["db"] and after["client"] == before["client"]


def test_label_edit_rerenders_the_edited_workload_and_its_protected_peers_only(api, db):
    web = make_workload(hostname="web", labels={"app": "web"}, mode="enforced")
    make_workload(hostname="other", labels={"app": "other"}, mode="enforced")
    newcomer = make_workload(hostname="newcomer", labels={"role": "nobody"}, mode="enforced")
    client_rule_ruleset(api)
    before = versions()
    response = api.put(
        f"/api/v1/workloads/{newcomer.id}/labels",
        {"labels": {"role": "client"}},
        format="json",
        HTTP_IF_MATCH='"1"',
    )
    assert response.status_code == 200
    after = versions()
    assert after["web"] != before["web"]  # the newcomer became web's peer
    assert after["other"] == before["other"]
    document = api.get(f"/api/v1/workloads/{web.id}/rendered-policy").json()["document"]
    assert newcomer.addresses[0] in document


def test_unchanged_documents_keep_their_version_and_are_not_written(api, db):
    make_workload(hostname="web", labels={"app": "web"}, mode="enforced")
    group = api.post(
        "/api/v1/address-groups", {"name": "unused", "members": ["10.0.0.0/8"]}, format="json"
    ).json()
    before = versions()
    api.put(
        f"/api/v1/address-groups/{group['id']}",
        {"name": "unused", "members": ["10.0.0.0/16"]},
        format="json",
        HTTP_IF_MATCH=f'"{group["version"]}"',
    )
    assert versions() == before


def test_connected_changed_workloads_are_told_after_commit(api, db, django_capture_on_commit_callbacks):
    web = connect(make_workload(hostname="web", labels={"app": "web"}, mode="enforced"))
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(stream_group(web.id), channel)
    with django_capture_on_commit_callbacks(execute=True):
        client_rule_ruleset(api)
    assert async_to_sync(layer.receive)(channel) == {"type": "policy.updated"}
    web.refresh_from_db()
    assert web.sync_state == "pending"


def test_mode_change_records_the_intent_and_renders(api, db):
    a = make_workload(hostname="a", labels={"env": "prod"})
    b = make_workload(hostname="b", labels={"env": "prod"}, mode="enforced")
    make_workload(hostname="c", labels={"env": "dev"})
    before = versions()
    response = api.post(
        "/api/v1/mode-changes", {"selection": {"labels": ["env=prod"]}, "mode": "enforced"}, format="json"
    )
    assert response.status_code == 202
    body = response.json()
    assert body["resolved_count"] == 2 and body["changed_count"] == 1 and body["mode"] == "enforced"
    assert body["actor"].startswith("token tests")
    intent = ModeChange.objects.get()
    assert intent.selection == {"labels": ["env=prod"]}
    after = versions()
    assert after["a"] != before["a"] and after["b"] == before["b"] and after["c"] == before["c"]
    a.refresh_from_db()
    assert a.mode == "enforced"
    assert api.get(f"/api/v1/workloads/{b.id}").json()["mode"] == "enforced"


def test_mode_change_selection_by_ids_narrows_labels(api, db):
    a = make_workload(hostname="a", labels={"env": "prod"})
    make_workload(hostname="b", labels={"env": "prod"})
    body = api.post(
        "/api/v1/mode-changes",
        {"selection": {"labels": ["env=prod"], "workload_ids": [str(a.id)]}, "mode": "simulation"},
        format="json",
    ).json()
    assert body["resolved_count"] == 1


def test_mode_change_refusals(api, db):
    make_workload(labels={"env": "prod"})
    cases = [
        ({"selection": {}, "mode": "enforced"}, "/selection", "empty-selection"),
        ({"selection": {"labels": ["env=nope"]}, "mode": "enforced"}, "/selection", "selects-nothing"),
        ({"selection": {"all": True}, "mode": "lockdown"}, "/mode", "mode"),
        (
            {"selection": {"labels": ["env in (a"]}, "mode": "enforced"},
            "/selection/labels/0",
            "selector-syntax",
        ),
        ({"selection": {"workload_ids": ["x"]}, "mode": "enforced"}, "/selection/workload_ids/0", "type"),
        ({"mode": "enforced"}, "/selection", "required"),
    ]
    for body, path, rule in cases:
        problem = assert_problem(api.post("/api/v1/mode-changes", body, format="json"), 422, "validation")
        assert (problem["errors"][0]["path"], problem["errors"][0]["rule"]) == (path, rule), body


def test_selector_preview(api, db):
    make_workload(hostname="a", labels={"env": "prod"})
    make_workload(hostname="b", labels={"env": "dev"})
    body = api.post(
        "/api/v1/selectors/preview", {"selector": "env in (prod, dev), env!=dev"}, format="json"
    ).json()
    assert body["selector"] == "env!=dev,env in (dev,prod)"
    assert body["count"] == 1 and [w["hostname"] for w in body["workloads"]] == ["a"]
    problem = assert_problem(
        api.post("/api/v1/selectors/preview", {"selector": "env in"}, format="json"), 422, "validation"
    )
    assert problem["errors"][0]["path"] == "/selector"


def test_render_dryrun_reports_changes_and_persists_nothing(api, db):
    web = make_workload(hostname="web", labels={"app": "web"}, mode="enforced")
    make_workload(hostname="client", labels={"role": "client"}, mode="enforced")
    existing = client_rule_ruleset(api)
    before = versions()
    hypothetical = {
        "rulesets": [
            {
                "name": "web",
                "scope": "app=web",
                "rules": [
                    {**existing["rules"][0], "services": [{"protocol": "tcp", "port": 8443}]},
                    {"sources": [{"selector": "role=ghost"}], "services": [{"service": "ssh"}]},
                ],
            }
        ],
        "services": [{"name": "ssh", "entries": [{"protocol": "tcp", "port": 22}]}],
    }
    body = api.post("/api/v1/policies/render-dryrun", hypothetical, format="json").json()
    assert body["changed_count"] == 1 and body["unchanged_count"] == 1
    (change,) = body["changed"]
    assert change["workload_id"] == str(web.id)
    assert change["rules_changed"] == [{"ruleset_name": "web", "rule_id": existing["rules"][0]["id"]}]
    assert len(change["rules_added"]) == 1 and change["rules_removed"] == []
    assert [w["path"] for w in body["warnings"]] == ["/rulesets/0/rules/1/sources/0/selector"]
    assert versions() == before
    problem = assert_problem(
        api.post(
            "/api/v1/policies/render-dryrun", {"rulesets": [{"name": "x", "scope": "a=("}]}, format="json"
        ),
        422,
        "validation",
    )
    assert problem["errors"][0]["path"] == "/rulesets/0/scope"


def test_documents_marked_stale_by_an_upgrade_are_rerendered_once(api, db):
    """A release whose renderer writes documents differently marks them stale in a migration; serve
    re-renders every workload before it listens, then never again until the next such release."""
    from fleet.rendering import documents_refresh_if_stale
    from policy.models import PolicyState

    make_workload(hostname="web", labels={"app": "web"}, mode="enforced")
    make_workload(hostname="db", labels={"app": "db"}, mode="enforced")
    client_rule_ruleset(api)
    rendered = versions()
    # What the previous release stored: a document this renderer would not write.
    Workload.objects.filter(hostname="web").update(latest_policy_id=rendered["db"])
    PolicyState.objects.filter(id=1).update(documents_stale=False)
    assert documents_refresh_if_stale() is None
    assert versions()["web"] == rendered["db"]

    PolicyState.objects.filter(id=1).update(documents_stale=True)
    refreshed = documents_refresh_if_stale()
    assert refreshed is not None and refreshed.considered == 2
    assert [Workload.objects.get(id=i).hostname for i in refreshed.changed] == ["web"]
    assert versions() == rendered
    assert not PolicyState.objects.get(id=1).documents_stale
    assert documents_refresh_if_stale() is None

"""The audit trail: every operator write records who, what, which object and the versions, in the
write's own transaction; it is read by GET /audit-events and `manage.py audit`, and never changed."""

import json

import pytest

from controlplane.models import AuditEvent
from tests.support.helpers import assert_problem, run_command
from tests.support.workloads import make_workload


def _events(api, **params):
    response = api.get("/api/v1/audit-events", params)
    assert response.status_code == 200, response.content
    return response.json()["items"]


def test_policy_writes_record_actor_object_and_versions(api):
    created = api.post(
        "/api/v1/services", {"name": "https", "entries": [{"protocol": "tcp", "port": 443}]}, format="json"
    ).json()
    api.put(
        f"/api/v1/services/{created['id']}",
        {"name": "https", "entries": [{"protocol": "tcp", "port": 8443}]},
        format="json",
        HTTP_IF_MATCH='"1"',
    )
    api.delete(f"/api/v1/services/{created['id']}", HTTP_IF_MATCH='"2"')
    events = _events(api, object_type="service", object_id=created["id"])
    assert [(e["action"], e["version_before"], e["version_after"]) for e in events] == [
        ("service.delete", "2", None),
        ("service.replace", "1", "2"),
        ("service.create", None, "1"),
    ]
    assert {e["actor"]["kind"] for e in events} == {"token"}
    assert all(e["actor"]["label"].startswith("token tests") and e["actor"]["token_id"] for e in events)
    assert events[0]["object"] == {"type": "service", "id": created["id"], "name": "https"}


def test_a_refused_write_records_nothing(api):
    api.post("/api/v1/services", {"name": "dns", "entries": [{"protocol": "udp", "port": 53}]}, format="json")
    before = AuditEvent.objects.count()
    assert_problem(
        api.post(
            "/api/v1/services", {"name": "dns", "entries": [{"protocol": "udp", "port": 53}]}, format="json"
        ),
        422,
        "validation",
    )
    service = api.get("/api/v1/services").json()["services"][0]
    assert_problem(
        api.delete(f"/api/v1/services/{service['id']}", HTTP_IF_MATCH='"9"'), 412, "precondition-failed"
    )
    assert AuditEvent.objects.count() == before


def test_labels_mode_changes_resend_and_tokens_are_recorded(api):
    workload = make_workload(labels={"app": "web"})
    api.put(
        f"/api/v1/workloads/{workload.id}/labels",
        {"labels": {"app": "api"}},
        format="json",
        HTTP_IF_MATCH='"1"',
    )
    api.post(
        "/api/v1/mode-changes",
        {"selection": {"workload_ids": [str(workload.id)]}, "mode": "simulation"},
        format="json",
    )
    minted = api.post("/api/v1/operator-tokens", {"name": "ci"}, format="json").json()
    api.delete(f"/api/v1/operator-tokens/{minted['record']['id']}")
    actions = [e["action"] for e in _events(api)]
    # The last is the `api` fixture's own token, minted from the host's command line.
    assert actions == [
        "operator_token.revoke",
        "operator_token.create",
        "mode_change.create",
        "workload.labels_replace",
        "operator_token.create",
    ]
    labels = _events(api, object_type="workload", object_id=str(workload.id))[0]
    assert labels["detail"] == {"labels_before": {"app": "web"}, "labels": {"app": "api"}}
    assert (labels["version_before"], labels["version_after"]) == ("1", "2")
    assert minted["token"] not in json.dumps(_events(api))  # a secret never reaches the trail


def test_host_commands_are_recorded_with_their_command_line(db, monkeypatch):
    from django.core.management import call_command, load_command_class

    # As manage.py runs it: run_from_argv keeps the command line (and would then close the test's
    # database connection, so the rest of it is what run_from_argv does).
    command = load_command_class("controlplane", "operator-password")
    command._argv = ["manage.py", "operator-password", "--stdin"]
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("correct horse battery staple\n"))
    call_command(command, "--stdin", stdout=__import__("io").StringIO())
    event = AuditEvent.objects.get()
    assert (event.actor_kind, event.actor, event.action) == (
        "cli",
        "host: manage.py operator-password --stdin",
        "operator.set_password",
    )
    code, out, _ = run_command("audit", "--json")
    assert code == 0
    assert json.loads(out)["items"][0]["actor"]["label"] == "host: manage.py operator-password --stdin"


def test_filters_paging_and_refusals(api, clock_at):
    from datetime import timedelta

    from controlplane import clock

    for n in range(3):
        api.post("/api/v1/address-groups", {"name": f"g{n}", "members": ["10.0.0.0/8"]}, format="json")
        clock_at(timedelta(minutes=1))
    groups = {"object_type": "address_group", "limit": 2}
    first = api.get("/api/v1/audit-events", groups).json()
    second = api.get("/api/v1/audit-events", {**groups, "cursor": first["next_cursor"]}).json()
    assert [e["object"]["name"] for e in first["items"] + second["items"]] == ["g2", "g1", "g0"]
    assert second["next_cursor"] is None
    since = clock.rfc3339(clock.now() - timedelta(minutes=2))
    assert [e["object"]["name"] for e in _events(api, since=since, object_type="address_group")] == ["g2"]
    assert_problem(api.get("/api/v1/audit-events", {"since": "yesterday"}), 422, "validation")
    assert_problem(api.get("/api/v1/audit-events", {"object_type": "nothing"}), 422, "validation")


@pytest.mark.parametrize("method", ["post", "put", "patch", "delete"])
def test_nothing_changes_or_deletes_the_trail(api, method):
    assert_problem(getattr(api, method)("/api/v1/audit-events"), 405, "method-not-allowed")


def test_a_command_run_from_its_command_line_is_named_by_it(monkeypatch):
    from django.core.management import BaseCommand, load_command_class

    monkeypatch.setattr(BaseCommand, "run_from_argv", lambda self, argv: None)  # parse, execute, close
    command = load_command_class("fleet", "workload")
    command.run_from_argv(["/srv/palisade/manage.py", "workload", "set-labels", "abc", "--file", "-"])
    assert command.actor.kind == "cli"
    assert command.actor.label == "host: manage.py workload set-labels abc --file -"

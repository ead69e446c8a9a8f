"""Mode changes that need confirming, in process: the deadline on the intent, confirming it, the
system's revert of an unconfirmed one (the mode each workload had before, the workloads a later change
took over left alone), its audit and webhook event, exactly once however many callers race for it;
the command line calls the same functions. serve's real timing, restarts and two processes are in
tests/e2e/test_mode_change_confirmation_in_namespaces.py."""

import json
from datetime import timedelta

import pytest
from django.db import connection

from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from controlplane.models import AuditEvent
from controlplane.validation import parse_instant
from controlplane.webhooks.models import WebhookEvent
from controlplane.webhooks.services import webhook_create
from fleet.mode_confirmations import mode_change_confirm, mode_changes_revert_due
from fleet.models import ModeChange, Workload
from fleet.services import mode_change_create
from tests.support.helpers import assert_problem, race
from tests.support.helpers import run_command as run
from tests.support.requirements import require
from tests.support.workloads import make_workload

pytestmark = pytest.mark.django_db


def change(api, mode, *, ids=None, labels=None, within=None):
    selection = {}
    if ids:
        selection["workload_ids"] = [str(i) for i in ids]
    if labels:
        selection["labels"] = labels
    body = {"selection": selection, "mode": mode}
    if within is not None:
        body["confirm_within_seconds"] = within
    answer = api.post("/api/v1/mode-changes", body, format="json")
    assert answer.status_code == 202, answer.content
    return answer.json()


def modes(*workloads):
    return [Workload.objects.get(id=w.id).mode for w in workloads]


def latest(workload):
    return Workload.objects.get(id=workload.id).latest_policy_id


def test_a_change_with_a_deadline_shows_it_and_what_it_would_put_back(api):
    web = make_workload(hostname="web", labels={"app": "web"}, mode="simulation")
    db = make_workload(hostname="db", labels={"app": "db"}, mode="visibility")
    already = make_workload(hostname="already", labels={"app": "x"}, mode="enforced")
    before = clock.now()
    intent = change(api, "enforced", ids=[web.id, db.id, already.id], within=300)
    confirm_by = parse_instant(intent["confirm_by"])
    created = parse_instant(intent["created_at"])
    assert confirm_by - created == timedelta(seconds=300) and created >= before
    assert intent["confirmation"] == "awaiting" and intent["changed_count"] == 2
    assert intent["confirmed_at"] is intent["reverted_by"] is intent["reverts"] is intent["reason"] is None
    detail = api.get(f"/api/v1/mode-changes/{intent['id']}").json()
    assert sorted(
        (w["workload_id"], w["mode_before"], w["mode_after"]) for w in detail["workloads"]
    ) == sorted(
        [(str(web.id), "simulation", "enforced"), (str(db.id), "visibility", "enforced")]
    )  # the workload already enforced has nothing to go back to
    awaiting = api.get("/api/v1/mode-changes", {"confirmation": "awaiting"}).json()
    assert [c["id"] for c in awaiting["items"]] == [intent["id"]]
    plain = change(api, "simulation", ids=[already.id])
    assert plain["confirm_by"] is None and plain["confirmation"] is None
    assert [c["id"] for c in api.get("/api/v1/mode-changes").json()["items"]] == [plain["id"], intent["id"]]
    assert (
        api.get("/api/v1/mode-changes", {"confirmation": "awaiting"}).json()["items"][0]["id"] == intent["id"]
    )
    audit = AuditEvent.objects.get(action="mode_change.create", object_id=intent["id"])
    assert audit.detail["confirm_by"] == intent["confirm_by"]


@pytest.mark.parametrize(
    "value, rule",
    [(9, "out-of-range"), (86_401, "out-of-range"), (0, "out-of-range"), ("300", "type"), (True, "type"),
     (12.5, "type")],
)  # fmt: skip
def test_the_deadline_is_10_seconds_to_a_day(api, value, rule):
    workload = make_workload()
    body = {"selection": {"all": True}, "mode": "enforced", "confirm_within_seconds": value}
    problem = assert_problem(api.post("/api/v1/mode-changes", body, format="json"), 422, "validation")
    assert [(e["path"], e["rule"]) for e in problem["errors"]] == [("/confirm_within_seconds", rule)]
    assert modes(workload) == ["visibility"] and not ModeChange.objects.exists()


def test_the_bounds_themselves_are_admitted_and_null_is_no_deadline(api):
    make_workload()
    body = {"selection": {"all": True}, "mode": "enforced"}
    for within, has_deadline in ((10, True), (86_400, True), (None, False)):
        answer = api.post("/api/v1/mode-changes", {**body, "confirm_within_seconds": within}, format="json")
        assert answer.status_code == 202, answer.content
        assert (answer.json()["confirm_by"] is not None) is has_deadline


def test_a_confirmed_change_stays_and_confirming_again_changes_nothing(api, clock_at):
    web = make_workload(mode="simulation")
    intent = change(api, "enforced", ids=[web.id], within=60)
    confirmed = api.post(f"/api/v1/mode-changes/{intent['id']}/confirm")
    assert confirmed.status_code == 200, confirmed.content
    data = confirmed.json()
    assert data["confirmation"] == "confirmed" and data["confirmed_by"].startswith("token tests")
    clock_at(timedelta(seconds=61))
    again = api.post(f"/api/v1/mode-changes/{intent['id']}/confirm")  # after the deadline too
    assert again.status_code == 200 and again.json() == data
    assert mode_changes_revert_due() == 0
    assert modes(web) == ["enforced"]
    assert AuditEvent.objects.filter(action="mode_change.confirm", object_id=intent["id"]).count() == 1
    assert not ModeChange.objects.filter(reverts_id=intent["id"]).exists()


def test_an_unconfirmed_change_is_put_back_by_the_system_once(api, clock_at):
    subscribe_all()
    web = make_workload(hostname="web", labels={"app": "web"}, mode="simulation")
    db = make_workload(hostname="db", labels={"app": "web"}, mode="visibility")
    documents = {w.hostname: latest(w) for w in (web, db)}
    intent = change(api, "enforced", labels=["app=web"], within=10)
    assert modes(web, db) == ["enforced", "enforced"] and latest(web) != documents["web"]
    clock_at(timedelta(seconds=9))
    assert mode_changes_revert_due() == 0  # not yet
    clock_at(timedelta(seconds=2))
    assert mode_changes_revert_due() == 1
    assert modes(web, db) == ["simulation", "visibility"]
    assert {w.hostname: latest(w) for w in (web, db)} == documents  # the same documents as before
    assert mode_changes_revert_due() == 0  # once

    original = api.get(f"/api/v1/mode-changes/{intent['id']}").json()
    assert original["confirmation"] == "reverted" and original["reverted_at"]
    revert = api.get(f"/api/v1/mode-changes/{original['reverted_by']}").json()
    assert revert["actor"] == "system" and revert["reverts"] == intent["id"]
    assert revert["reason"] == f"Mode change {intent['id']} was not confirmed by {intent['confirm_by']}."
    assert revert["mode"] is None  # back to two different modes
    assert revert["changed_count"] == revert["resolved_count"] == 2 and revert["left_alone"] == []
    assert sorted(
        (w["workload_id"], w["mode_before"], w["mode_after"]) for w in revert["workloads"]
    ) == sorted([(str(web.id), "enforced", "simulation"), (str(db.id), "enforced", "visibility")])
    assert revert["confirm_by"] is None and revert["confirmation"] is None

    (audit,) = AuditEvent.objects.filter(action="mode_change.revert")
    assert (audit.actor_kind, audit.actor, audit.object_id) == ("system", "system", revert["id"])
    assert audit.detail["reverts"] == intent["id"] and len(audit.detail["workloads"]) == 2
    listed = api.get("/api/v1/audit-events", {"object_type": "mode_change", "object_id": revert["id"]})
    assert listed.json()["items"][0]["actor"]["kind"] == "system"

    (event,) = WebhookEvent.objects.filter(type="mode_change.reverted")
    assert event.workload_id is None and event.data["actor"] == "system"
    assert event.data["mode_change"]["id"] == revert["id"]
    assert event.data["mode_change"]["reverts"] == intent["id"]
    assert sorted(event.data["mode_change"]["changed_workload_ids"]) == sorted([str(web.id), str(db.id)])
    assert event.data["left_alone"] == []


def test_a_confirmation_after_the_deadline_is_refused_before_and_after_the_revert(api, clock_at):
    web = make_workload(mode="simulation")
    intent = change(api, "enforced", ids=[web.id], within=10)
    clock_at(timedelta(seconds=11))
    late = assert_problem(
        api.post(f"/api/v1/mode-changes/{intent['id']}/confirm"), 409, "confirmation-deadline-passed"
    )
    assert late["confirm_by"] == intent["confirm_by"] and late["reverted_by"] is None
    mode_changes_revert_due()
    later = assert_problem(
        api.post(f"/api/v1/mode-changes/{intent['id']}/confirm"), 409, "confirmation-deadline-passed"
    )
    revert = ModeChange.objects.get(reverts_id=intent["id"])
    assert later["reverted_by"] == str(revert.id) and str(revert.id) in later["detail"]
    assert modes(web) == ["simulation"]
    assert not AuditEvent.objects.filter(action="mode_change.confirm").exists()


def test_the_deadline_itself_still_counts(api, monkeypatch):
    web = make_workload(mode="simulation")
    intent = change(api, "enforced", ids=[web.id], within=10)
    deadline = ModeChange.objects.get(id=intent["id"]).confirm_by
    monkeypatch.setattr(clock, "now", lambda: deadline)
    assert mode_changes_revert_due() == 0
    assert api.post(f"/api/v1/mode-changes/{intent['id']}/confirm").json()["confirmation"] == "confirmed"


def test_nothing_to_confirm_is_a_problem(api, clock_at):
    web = make_workload()
    plain = change(api, "enforced", ids=[web.id])
    problem = assert_problem(
        api.post(f"/api/v1/mode-changes/{plain['id']}/confirm"), 409, "no-confirmation-deadline"
    )
    assert plain["id"] in problem["detail"]
    timed = change(api, "simulation", ids=[web.id], within=10)
    clock_at(timedelta(seconds=11))
    mode_changes_revert_due()
    revert = ModeChange.objects.get(reverts_id=timed["id"])
    assert_problem(api.post(f"/api/v1/mode-changes/{revert.id}/confirm"), 409, "no-confirmation-deadline")
    for missing in ("00000000-0000-0000-0000-000000000000", "not-an-id"):
        assert_problem(api.post(f"/api/v1/mode-changes/{missing}/confirm"), 404, "not-found")
        assert_problem(api.get(f"/api/v1/mode-changes/{missing}"), 404, "not-found")
    assert not AuditEvent.objects.filter(action="mode_change.confirm").exists()


def test_workloads_a_later_change_took_over_are_left_alone_and_listed(api, clock_at):
    subscribe_all()
    web = make_workload(hostname="web", mode="simulation")
    db = make_workload(hostname="db", mode="simulation")
    cache = make_workload(hostname="cache", mode="simulation")
    intent = change(api, "enforced", ids=[web.id, db.id, cache.id], within=10)
    moved = change(api, "visibility", ids=[db.id])  # moved it
    kept = change(api, "enforced", ids=[cache.id])  # selected it without moving it: the latest word
    clock_at(timedelta(seconds=11))
    assert mode_changes_revert_due() == 1
    assert modes(web, db, cache) == ["simulation", "visibility", "enforced"]
    revert = ModeChange.objects.get(reverts_id=intent["id"])
    assert revert.mode == "simulation" and revert.changed_count == 1 and revert.resolved_count == 3
    assert sorted(revert.left_alone, key=lambda w: w["mode"]) == [
        {"workload_id": str(cache.id), "mode": "enforced", "moved_by": kept["id"]},
        {"workload_id": str(db.id), "mode": "visibility", "moved_by": moved["id"]},
    ]
    (event,) = WebhookEvent.objects.filter(type="mode_change.reverted")
    assert event.data["left_alone"] == revert.left_alone
    assert event.data["mode_change"]["changed_workload_ids"] == [str(web.id)]


def test_unconfirmed_changes_one_over_another_go_back_to_where_the_first_started(api, clock_at):
    web = make_workload(mode="visibility")
    first = change(api, "simulation", ids=[web.id], within=10)
    second = change(api, "enforced", ids=[web.id], within=20)
    again = change(api, "enforced", ids=[web.id], within=30)  # moves nothing, still holds it
    detail = api.get(f"/api/v1/mode-changes/{again['id']}").json()
    assert [(w["mode_before"], w["mode_after"]) for w in detail["workloads"]] == [("visibility", "enforced")]
    clock_at(timedelta(seconds=25))
    assert mode_changes_revert_due() == 2
    assert modes(web) == ["enforced"]  # the first two were taken over: left alone
    for earlier in (first, second):  # each lists the change that holds the workload now
        (left,) = ModeChange.objects.get(reverts_id=earlier["id"]).left_alone
        assert left == {"workload_id": str(web.id), "mode": "enforced", "moved_by": again["id"]}
    clock_at(timedelta(seconds=10))
    assert mode_changes_revert_due() == 1
    assert modes(web) == ["visibility"]


def test_a_confirmed_earlier_change_is_what_a_later_one_goes_back_to(api, clock_at):
    web = make_workload(mode="visibility")
    first = change(api, "simulation", ids=[web.id], within=10)
    api.post(f"/api/v1/mode-changes/{first['id']}/confirm")
    change(api, "enforced", ids=[web.id], within=10)
    clock_at(timedelta(seconds=11))
    assert mode_changes_revert_due() == 1
    assert modes(web) == ["simulation"]


@pytest.mark.postgres
def test_racing_reverts_put_each_change_back_once(transactional_db, api, clock_at):
    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    workloads = [make_workload(mode="simulation") for _ in range(8)]
    intents = [change(api, "enforced", ids=[w.id], within=10) for w in workloads]
    clock_at(timedelta(seconds=11))
    results = race(*[mode_changes_revert_due for _ in range(4)])
    assert not [r for r in results if isinstance(r, Exception)], results
    assert sum(results) == len(intents)
    for intent in intents:
        assert ModeChange.objects.filter(reverts_id=intent["id"]).count() == 1
    assert AuditEvent.objects.filter(action="mode_change.revert").count() == len(intents)
    assert set(modes(*workloads)) == {"simulation"}


@pytest.mark.postgres
def test_a_confirmation_racing_the_revert_either_wins_or_is_refused(transactional_db, clock_at, monkeypatch):
    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    web = make_workload(mode="simulation")
    intent = mode_change_create(
        actor=CLI_ACTOR,
        data={"selection": {"workload_ids": [str(web.id)]}, "mode": "enforced", "confirm_within_seconds": 10},
    )
    deadline = intent.confirm_by
    # The confirmation is in time and the revert's round is past the deadline: whichever locks first wins.
    monkeypatch.setattr(clock, "now", lambda: deadline)
    confirmed, reverted = race(
        lambda: mode_change_confirm(actor=CLI_ACTOR, mode_change_id=intent.id),
        lambda: mode_changes_revert_due(now=deadline + timedelta(seconds=1)),
    )
    intent.refresh_from_db()
    if reverted == 1:
        assert intent.reverted_at and intent.confirmed_at is None and modes(web) == ["simulation"]
        assert getattr(confirmed, "name", None) == "confirmation-deadline-passed"
    else:
        assert reverted == 0 and intent.confirmed_at and intent.reverted_at is None
        assert modes(web) == ["enforced"] and isinstance(confirmed, ModeChange)


def test_the_command_line_calls_the_same_functions(api, clock_at):
    web = make_workload(labels={"app": "web"}, mode="simulation")
    code, out, _ = run("mode-change", "enforced", "--label", "app=web", "--confirm-within", "300", "--json")
    assert code == 0
    made = json.loads(out)
    assert made["confirmation"] == "awaiting" and made["changed_count"] == 1
    code, out, _ = run("mode-change", "show", made["id"], "--json")
    assert json.loads(out) == api.get(f"/api/v1/mode-changes/{made['id']}").json()
    code, out, _ = run("mode-change", "list", "--confirmation", "awaiting", "--json")
    assert [c["id"] for c in json.loads(out)] == [made["id"]]
    code, out, _ = run("mode-change", "enforced", "--label", "app=web")
    assert code == 0 and "reverts unless" not in out
    code, out, _ = run("mode-change", "simulation", "--workload", str(web.id), "--confirm-within", "10")
    assert code == 0 and "manage.py mode-change confirm" in out
    timed = ModeChange.objects.filter(confirm_by__isnull=False).order_by("-created_at").first()
    code, out, _ = run("mode-change", "confirm", str(timed.id))
    assert code == 0 and "confirmed at" in out
    assert AuditEvent.objects.get(action="mode_change.confirm").actor_kind == "cli"
    clock_at(timedelta(seconds=301))
    code, _, err = run("mode-change", "confirm", made["id"])
    assert code == 1 and err.count("\n") == 1 and "[confirmation-deadline-passed]" in err
    code, _, err = run("mode-change", "enforced", "--all", "--confirm-within", "5")
    assert code == 2 and "[out-of-range]" in err
    code, _, err = run("mode-change", "list", "--confirmation", "soon")
    assert code == 2 and "[confirmation]" in err


def test_the_list_filter_is_checked(api):
    problem = assert_problem(api.get("/api/v1/mode-changes", {"confirmation": "soon"}), 422, "validation")
    assert [(e["path"], e["rule"]) for e in problem["errors"]] == [("?confirmation", "confirmation")]


def subscribe_all():
    webhook_create(
        actor=CLI_ACTOR,
        data={
            "url": "https://192.0.2.10/palisade",
            "events": ["mode_change.requested", "mode_change.reverted"],
        },
    )

"""The console's "policy from evidence" pages in process: rules suggested from
stored flows of known counts, read with their evidence, saved through the API; and the impact of a rule
edit over past traffic beside the dry-run."""

from __future__ import annotations

import html
import itertools
import re
import uuid
from datetime import timedelta

import pytest
from django.test import Client

from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from fleet.services import workload_labels_replace
from flows.services import flow_report_ingest
from policy import services as policy_services
from policy.models import AddressGroup, Ruleset, Service
from tests.support.flow_evidence import enrolled, flow_report, windows_between

pytestmark = pytest.mark.django_db

_uptimes = itertools.count(100)
OUTSIDE = "198.51.100.7"
MINUTES = 20


@pytest.fixture
def browser(operator_password):
    client = Client()
    assert client.post("/login", {"password": operator_password, "next": "/policy"}).status_code == 302
    return client


def text(response) -> str:
    return re.sub(r"\s+", " ", response.content.decode())


def _labelled(hostname, address, labels):
    workload, _, _ = enrolled(hostname, address)
    return workload_labels_replace(
        actor=CLI_ACTOR, workload_id=str(workload.id), expected_version=str(workload.labels_version),
        data={"labels": labels},
    )  # fmt: skip


def _ingest(workload, gaps=()):
    """Two web clients to tcp/5432 of the server (1 and 2 connections a minute) and the outside address
    to tcp/22 (2 a minute), for 20 minutes, all `observed`."""
    windows = windows_between(clock.now() - timedelta(minutes=30), MINUTES)
    for window in windows:
        template = window["groups"][0]
        window["groups"] = [
            {**template, "peer": "10.50.0.20", "port": 5432, "connection_count": 1},
            {**template, "peer": "10.50.0.21", "port": 5432, "connection_count": 2},
            {**template, "peer": OUTSIDE, "port": 22, "connection_count": 2},
        ]
    report = flow_report("p1", next(_uptimes), windows)
    report["gaps"] = list(gaps)
    answer = flow_report_ingest(workload_id=str(workload.id), data=report)
    assert all(r["result"] == "accepted" for r in answer["windows"] + answer["gaps"]), answer


@pytest.fixture
def server(db):
    server = _labelled("db1", "10.50.0.10", {"app": "db"})
    for i in range(2):
        _labelled(f"web{i}", f"10.50.0.{20 + i}", {"app": "web"})
    return server


def _suggested(browser, server, **extra):
    return browser.post(
        "/policy/suggest",
        {"workloads": str(server.id), "range": "1h", "label_keys": "app", "action": "suggest", **extra},
    )


def _draft(response) -> str:
    """The draft's textarea as the browser would send it back."""
    found = re.search(r'<textarea id="suggest-draft"[^>]*>(.*?)</textarea>', response.content.decode(), re.S)
    assert found is not None, text(response)[:2000]
    return html.unescape(found[1])


def _save_fields(response, drop=()) -> dict:
    """What the browser sends back on "Save the ticked rules": the proposal, the ticked rules (but
    `drop`), the ruleset names and the untouched draft."""
    page = response.content.decode()
    proposal = re.search(r'<input type="hidden" name="proposal" value="([^"]*)"', page)
    assert proposal is not None, text(response)[:2000]
    keep = [k for k in re.findall(r'name="keep" value="([^"]+)" checked', page) if k not in drop]
    names = dict(re.findall(r'name="(name-\d+)" value="([^"]*)"', page))
    return {"action": "save", "proposal": html.unescape(proposal[1]), "keep": keep,
            "draft": _draft(response), **{k: html.unescape(v) for k, v in names.items()}}  # fmt: skip


def test_suggest_shows_the_proposal_with_its_evidence_then_saves_it_and_links_to_simulation(browser, server):
    _ingest(server)
    assert "Suggest rules" in text(browser.get("/policy"))
    assert browser.get("/policy/suggest").status_code == 200

    response = _suggested(browser, server)
    page = text(response)
    assert response.status_code == 200, page[:2000]
    assert page.count("data-proposed-rule>") + page.count("data-proposed-rule ") == 2
    assert "app=web" in page and "group:suggested app=db rule 1 peers" in page and "tcp/5432" in page
    counts = sorted(int(n) for n in re.findall(r"data-connections>(\d+)<", page))
    assert counts == [2 * MINUTES, 3 * MINUTES]  # the outside address's; the two web clients'
    assert "Complete: no evidence gap" in page and "data-incomplete" not in page
    # peers by host name, collapsed into a count
    assert "<summary>2 peers</summary>" in page and ">web0</a>" in page and ">web1</a>" in page

    saved = browser.post(
        "/policy/suggest", {"workloads": str(server.id), "range": "1h", **_save_fields(response)}
    )
    page = text(saved)
    assert saved.status_code == 200, page[:2000]
    assert "Saved" in page and "ruleset" in page and "suggested app=db rule 1 peers" in page
    link = re.search(r'href="(/mode-changes\?[^"]*)" data-simulation', page)
    assert link is not None and "mode=simulation" in link[1] and str(server.id) in link[1]
    prefilled = text(browser.get(html.unescape(link[1])))
    assert "1 workload selected" in prefilled and 'value="simulation" checked' in prefilled
    # Saved, the same range has nothing left to propose: the new rules admit it all.
    again = text(_suggested(browser, server))
    assert "data-no-proposal" in again and "a rule in force admits" in again


def test_rules_dropped_are_not_saved_and_a_refusal_keeps_the_proposal_with_the_finding_at_its_rule(
    browser, server
):
    _ingest(server)
    policy_services.service_create(
        actor=CLI_ACTOR, data={"name": "pg", "entries": [{"protocol": "tcp", "port": 5432}]}
    )
    response = _suggested(browser, server)
    fields = _save_fields(response)
    assert fields["keep"] == ["0.0", "0.1"]
    # the draft names the stored service `pg`; deleted before the save, the API refuses the rule
    service = Service.objects.get(name="pg")
    policy_services.service_delete(
        actor=CLI_ACTOR, service_id=str(service.id), expected_version=str(service.version)
    )
    refused = browser.post("/policy/suggest", fields)
    page = text(refused)
    assert refused.status_code == 422
    assert "nothing was saved" in page and AddressGroup.objects.count() == 0
    # the proposal and its evidence are still there, the finding at the second rule
    assert page.count("data-proposed-rule") >= 2 and "data-connections" in page
    row = re.search(r"<tr data-rule-findings>(.*?)</tr>", refused.content.decode(), re.S)
    assert row is not None and "/rulesets/0/rules/1/services/0/service" in row[1]
    # the second rule dropped: the rest saves, and only what it names
    saved = browser.post("/policy/suggest", _save_fields(refused, drop=("0.1",)))
    assert saved.status_code == 200, text(saved)[:2000]
    assert AddressGroup.objects.count() == 1
    ruleset = Ruleset.objects.get(name="suggested app=db")
    assert ruleset.rules.count() == 1
    not_json = browser.post("/policy/suggest", {"action": "save", "draft": "{rulesets"})
    assert not_json.status_code == 422 and "The draft is not JSON" in text(not_json)


def test_a_suggestion_from_an_incomplete_range_says_so_and_names_the_intervals(browser, server):
    at = clock.now() - timedelta(minutes=25)
    instant = lambda t: t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # noqa: E731
    gap = {"id": str(uuid.uuid4()), "kind": "source_restart", "source": "conntrack",
           "start": instant(at), "end": instant(at + timedelta(seconds=30)), "lost": {}}  # fmt: skip
    _ingest(server, gaps=[gap])
    page = text(_suggested(browser, server))
    assert "data-incomplete" in page and "Learnt from an incomplete range." in page
    assert "evidence gap (source_restart)" in page and at.strftime("%Y-%m-%d %H:%M") in page


def test_bad_input_to_suggest_is_shown_next_to_the_field(browser, server):
    response = _suggested(browser, server, label_keys="app", aggregate_prefix="99")
    assert response.status_code == 422
    assert 'id="aggregate_prefix-errors"' in text(response)


def test_a_rule_edit_shows_its_impact_over_past_traffic_in_words_before_saving(browser, server):
    _ingest(server)
    ruleset = policy_services.ruleset_create(
        actor=CLI_ACTOR,
        data={"name": "db", "scope": "app=db", "enabled": True, "rules": [
            {"description": "web to postgres", "sources": [{"selector": "app=web"}],
             "services": [{"protocol": "tcp", "port": 5432}]},
        ]},
    )  # fmt: skip
    rule = ruleset.rules.get()
    edit = f"/policy/rulesets/{ruleset.id}/rules/{rule.id}"
    form = text(browser.get(edit))
    assert "Impact over past traffic" in form and '<option value="7d" selected>' in form

    # Moving the rule from tcp/5432 to tcp/5433 refuses what it admitted, and admits nothing seen.
    response = browser.post(
        edit,
        {"sources": "app=web", "services": "tcp/5433", "version": str(rule.version), "action": "impact"},
    )
    page = text(response)
    assert response.status_code == 200, page[:2000]
    assert (
        f"Over the last 7 days this change would have refused {3 * MINUTES} connections from 2 peers "
        "to 1 service." in page
    )
    assert "data-newly-refused" in page and "data-newly-admitted" not in page and "web0" in page
    # grouped by workload, then service, with totals; peers by host name behind a count
    assert page.count("data-impact-workload") == 1
    assert f"db1</a> (visibility): {3 * MINUTES} connections from 2 peers to 1 service" in page
    assert "<summary>2 peers</summary>" in page and f"{3 * MINUTES} connections, 2 keys, 1 workloads" in page
    assert "Nothing was saved" in page and "data-impact-incomplete" not in page
    assert "tcp/5432" in text(browser.get(f"/policy/rulesets/{ruleset.id}"))  # and nothing was

    # Admitting anyone on tcp/22 instead: newly admitted, said after the refused.
    both = text(
        browser.post(
            edit,
            {
                "sources": "any",
                "services": "tcp/22",
                "version": str(rule.version),
                "action": "impact",
                "impact_range": "1h",
            },
        )
    )
    assert (
        "Over the last hour this change would have refused 60 connections from 2 peers to 1 service, " in both
    )
    assert f"and would have admitted {2 * MINUTES} connections from 1 peer to 1 service" in both


def test_the_impact_over_a_range_with_a_gap_says_it_is_a_lower_bound(browser, server):
    at = clock.now() - timedelta(minutes=25)
    instant = lambda t: t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # noqa: E731
    gap = {"id": str(uuid.uuid4()), "kind": "source_restart", "source": "conntrack",
           "start": instant(at), "end": instant(at + timedelta(seconds=30)), "lost": {}}  # fmt: skip
    _ingest(server, gaps=[gap])
    created = browser.post("/policy/rulesets/new", {"name": "db", "scope": "app=db", "enabled": "on"})
    page = text(
        browser.post(
            f"{created['Location']}/rules/new",
            {"sources": "app=web", "services": "tcp/5432", "action": "impact"},
        )
    )
    assert f"would have admitted {3 * MINUTES} connections from 2 peers to 1 service" in page
    assert "data-impact-incomplete" in page and "Incomplete:" in page


def test_moving_to_enforced_shows_what_the_policy_in_force_would_refuse_beside_the_review(browser, server):
    _ingest(server)
    query = f"/mode-changes?workloads={server.id}&mode=enforced&range=1h"
    page = text(browser.get(query))
    assert "Verdict:" in page and "data-enforced-impact" in page
    assert (
        f"Over the last hour the policy in force would have refused {5 * MINUTES} connections from 3 peers "
        "to 2 services to these workloads once enforced." in page
    )
    policy_services.ruleset_create(
        actor=CLI_ACTOR,
        data={"name": "db", "scope": "app=db", "enabled": True, "rules": [
            {"description": "", "sources": [{"selector": "app=web"}],
             "services": [{"protocol": "tcp", "port": 5432}]},
        ]},
    )  # fmt: skip
    page = text(browser.get(query))
    assert f"would have refused {2 * MINUTES} connections from 1 peer to 1 service" in page
    assert OUTSIDE in page and "data-refused-when-enforced" in page
    assert "data-enforced-impact" not in text(browser.get(query.replace("enforced", "simulation")))


def test_a_ruleset_edit_shows_its_impact_before_saving(browser, server):
    _ingest(server)
    ruleset = policy_services.ruleset_create(
        actor=CLI_ACTOR,
        data={"name": "db", "scope": "app=db", "enabled": True, "rules": [
            {"description": "", "sources": [{"selector": "app=web"}],
             "services": [{"protocol": "tcp", "port": 5432}]},
        ]},
    )  # fmt: skip
    url = f"/policy/rulesets/{ruleset.id}"
    assert "Impact over past traffic" in text(browser.get(url))
    disabled = {"name": "db", "scope": "app=db", "version": str(ruleset.version), "action": "impact"}
    page = text(browser.post(url, disabled))  # `enabled` unchecked
    assert f"Over the last 7 days this change would have refused {3 * MINUTES} connections" in page
    assert "Saved." not in page
    bad = browser.post(url, {**disabled, "enabled": "on", "scope": "app in ("})
    assert bad.status_code == 422 and 'id="scope-errors"' in text(bad)
    assert "Nothing would change" not in text(bad) and "data-impact" not in text(bad)


def test_an_address_group_edit_shows_its_impact_before_saving(browser, server):
    _ingest(server)
    group = policy_services.address_group_create(
        actor=CLI_ACTOR, data={"name": "outside", "members": [OUTSIDE]}
    )
    policy_services.ruleset_create(
        actor=CLI_ACTOR,
        data={"name": "db", "scope": "app=db", "enabled": True, "rules": [
            {"description": "", "sources": [{"address_group": "outside"}],
             "services": [{"protocol": "tcp", "port": 22}]},
        ]},
    )  # fmt: skip
    url = f"/policy/address-groups/{group.id}"
    assert "Impact over past traffic" in text(browser.get(url))
    edited = {"name": "outside", "text": "198.51.100.8", "version": str(group.version), "action": "impact"}
    page = text(browser.post(url, edited))
    assert (
        f"Over the last 7 days this change would have refused {2 * MINUTES} connections from 1 peer" in page
    )
    assert AddressGroup.objects.get(id=group.id).members == [OUTSIDE]  # nothing saved
    bad = browser.post(url, {**edited, "text": "not an address"})
    assert bad.status_code == 422 and 'id="text-errors"' in text(bad)


def test_outbound_suggestions_propose_destinations_save_and_link_to_the_outbound_mode(browser, server):
    """The direction chosen on the form: the database's own outgoing connections, proposed as an
    outbound ruleset whose rules name destinations, saved as it is."""
    windows = windows_between(clock.now() - timedelta(minutes=30), 5)
    for window in windows:
        template = window["groups"][0]
        window["groups"] = [
            {**template, "peer": OUTSIDE, "port": 443, "connection_count": 2, "direction": "outbound"},
            {**template, "peer": "10.50.0.20", "port": 8080, "connection_count": 1, "direction": "outbound"},
        ]
    answer = flow_report_ingest(workload_id=str(server.id), data=flow_report("p1", next(_uptimes), windows))
    assert all(r["result"] == "accepted" for r in answer["windows"]), answer
    # Inbound (the default): the database received nothing.
    assert "data-no-proposal" in text(_suggested(browser, server))

    response = _suggested(browser, server, direction="outbound")
    page = text(response)
    assert response.status_code == 200, page[:2000]
    assert "data-outbound" in page and "Destinations seen" in page
    assert "group:suggested app=db rule 1 destinations" in page and "app=web" in page
    assert 'value="outbound" selected' in page
    saved = browser.post(
        "/policy/suggest",
        {"workloads": str(server.id), "range": "1h", "direction": "outbound", **_save_fields(response)},
    )
    page = text(saved)
    assert saved.status_code == 200 and "Saved" in page, page[:2000]
    [ruleset] = Ruleset.objects.filter(name__startswith="suggested app=db")
    assert ruleset.direction == "outbound"
    link = re.search(r'href="(/mode-changes\?[^"]*)" data-simulation', page)
    assert link is not None and "direction=outbound" in link[1]
    again = text(_suggested(browser, server, direction="outbound"))
    assert "data-no-proposal" in again


def test_an_outbound_rule_edit_shows_its_impact_on_the_connections_the_workloads_open(browser, server):
    """The impact of an outbound rule's edit is judged on the outbound evidence (the whole stored set is
    posted, which alone would be judged on inbound evidence)."""
    _ingest(server)  # inbound evidence beside: not what this edit changes
    windows = windows_between(clock.now() - timedelta(minutes=30), 5)
    for window in windows:
        template = window["groups"][0]
        window["groups"] = [
            {**template, "peer": OUTSIDE, "port": 443, "connection_count": 2, "direction": "outbound"}
        ]
    answer = flow_report_ingest(workload_id=str(server.id), data=flow_report("p1", next(_uptimes), windows))
    assert all(r["result"] == "accepted" for r in answer["windows"]), answer
    policy_services.ruleset_create(
        actor=CLI_ACTOR,
        data={"name": "db", "scope": "app=db", "rules": [
            {"sources": [{"selector": "app=web"}], "services": [{"protocol": "tcp", "port": 5432}]}]},
    )  # fmt: skip
    egress = policy_services.ruleset_create(
        actor=CLI_ACTOR,
        data={"name": "db out", "scope": "app=db", "direction": "outbound", "rules": [
            {"destinations": [{"any": True}], "services": [{"protocol": "tcp", "port": 443}]}]},
    )  # fmt: skip
    rule = egress.rules.get()
    response = browser.post(
        f"/policy/rulesets/{egress.id}/rules/{rule.id}",
        {"sources": "any", "services": "tcp/8443", "version": str(rule.version), "action": "impact",
         "impact_range": "1h"},
    )  # fmt: skip
    page = text(response)
    assert response.status_code == 200, page[:2000]
    assert "this change would have refused 10 connections from 1 peer to 1 service" in page, page[:3000]

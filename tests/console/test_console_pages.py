"""The console in-process (Django's test client): every page renders from the API alone, refusals are
shown in words where they happen, and the security headers are on every page. The browser tests
(test_console_in_browser.py) drive the same pages in Chromium against the real serve."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from tests.support.workloads import connect, make_workload

pytestmark = pytest.mark.django_db


@pytest.fixture
def browser(operator_password):
    client = Client()
    response = client.post("/login", {"password": operator_password, "next": "/policy"})
    assert response.status_code == 302 and response["Location"] == "/policy"
    return client


def text(response) -> str:
    return re.sub(r"\s+", " ", response.content.decode())


def test_pages_need_a_session_and_send_the_operator_back_after_login(operator_password):
    client = Client()
    response = client.get("/flows?range=1h")
    assert response.status_code == 302 and response["Location"].startswith("/login?next=")
    refused = client.post("/login", {"password": "wrong", "next": "/flows"})
    assert refused.status_code == 401 and "problem" in text(refused)
    assert (
        client.post("/login", {"password": operator_password, "next": "https://evil.example/"})["Location"]
        == "/"
    )


def test_a_session_ended_elsewhere_sends_the_page_to_login(browser):
    assert browser.get("/").status_code == 200
    browser.post("/logout")
    response = browser.get("/")
    assert response.status_code == 302 and "/login" in response["Location"]


@pytest.mark.parametrize(
    "path", ["/", "/policy", "/policy/rulesets/new", "/policy/services/new", "/policy/address-groups/new",
             "/mode-changes", "/review", "/review?range=1h", "/flows", "/tokens", "/about"],
)  # fmt: skip
def test_every_page_renders_with_a_strict_content_security_policy(browser, path):
    response = browser.get(path)
    assert response.status_code == 200, text(response)[:2000]
    policy = response["Content-Security-Policy"]
    assert (
        "script-src 'self'" in policy and "unsafe-inline" not in policy and "frame-ancestors 'none'" in policy
    )
    assert response["X-Frame-Options"] == "DENY"
    assert "<script>" not in response.content.decode() and " style=" not in response.content.decode()


def test_fleet_shows_each_workload_with_its_chips(browser):
    offline = make_workload(hostname="never-1")
    synced = connect(make_workload(hostname="up-1", labels={"env": "prod"}))
    page = text(browser.get("/"))
    assert "never-1" in page and "offline: never connected" in page
    assert "up-1" in page and "env=prod" in page
    assert "never-1" not in text(browser.get("/?label=env%3Dprod"))
    partial = browser.get("/", headers={"HX-Request": "true"})
    assert "<html" not in partial.content.decode() and 'id="fleet"' in partial.content.decode()
    assert str(offline.id) in text(browser.get(f"/workloads/{offline.id}"))
    assert browser.get(f"/workloads/{synced.id}").status_code == 200
    assert browser.get("/workloads/not-a-workload").status_code == 404
    missing = browser.get("/no/such/page", headers={"Accept": "text/html,*/*"})
    assert missing.status_code == 404 and "There is no page at /no/such/page" in text(missing)
    scripted = browser.get("/no/such/page")  # no browser: the API's problem, as everywhere
    assert scripted.status_code == 404 and scripted["Content-Type"] == "application/problem+json"
    assert browser.get("/api/v1/no-such").status_code == 404  # the API's own problem, not a page


def test_a_hand_edit_of_the_table_shows_in_the_fleet_list_and_on_the_workload(browser):
    from datetime import timedelta

    from controlplane import clock
    from fleet.models import Workload

    edited = connect(make_workload(hostname="edited-1"))
    seen = clock.now() - timedelta(minutes=5)
    Workload.objects.filter(id=edited.id).update(
        table_modified_at=seen,
        table_restored_at=seen + timedelta(milliseconds=80),
        table_modification="chain input: 1 rule added",
    )
    assert "Table edited on host 5 min ago, restored" in text(browser.get("/"))
    page = browser.get(f"/workloads/{edited.id}").content.decode()
    fact = re.search(r'data-fact="table-modified">(.*?)</dd>', page, re.S)
    assert fact and "chain input: 1 rule added" in fact[1] and "restored" in fact[1]
    untouched = connect(make_workload(hostname="clean-1"))
    assert re.search(
        r'data-fact="table-modified">never<', browser.get(f"/workloads/{untouched.id}").content.decode()
    )


def test_a_label_edit_that_meets_a_conflict_says_so_with_the_current_version(browser):
    workload = make_workload(hostname="web-1", labels={"app": "web"})
    url = f"/workloads/{workload.id}/labels"
    first = browser.post(url, {"labels": "app=web\nenv=prod", "version": "1"})
    assert "Labels saved" in text(first), text(first)[:3000]
    stale = browser.post(url, {"labels": "app=api", "version": "1"})
    page = text(stale)
    assert "Changed since you opened it" in page and "env=prod" in page


def test_a_rule_with_a_validation_error_shows_it_next_to_the_field_then_saves(browser):
    created = browser.post("/policy/rulesets/new", {"name": "web", "scope": "app=web", "enabled": "on"})
    assert created.status_code == 302, text(created)[:3000]
    ruleset_url = created["Location"]
    bad = browser.post(
        f"{ruleset_url}/rules/new", {"sources": "role in (", "services": "tcp/443", "action": "save"}
    )
    assert bad.status_code == 422
    assert 'id="sources-errors"' in bad.content.decode()
    superscript = browser.post(
        f"{ruleset_url}/rules/new", {"sources": "role=client", "services": "tcp/4²", "action": "save"}
    )
    assert superscript.status_code == 422 and 'id="services-errors"' in superscript.content.decode()
    good = browser.post(
        f"{ruleset_url}/rules/new", {"sources": "role=client", "services": "tcp/443", "action": "save"}
    )
    assert good.status_code == 302
    assert "role=client" in text(browser.get(ruleset_url))


def test_deleting_a_referenced_service_says_by_what(browser):
    browser.post("/policy/services/new", {"name": "https", "text": "tcp/443"})
    created = browser.post("/policy/rulesets/new", {"name": "web", "scope": "", "enabled": "on"})
    browser.post(
        f"{created['Location']}/rules/new", {"sources": "any", "services": "https", "action": "save"}
    )
    policy = browser.get("/policy").content.decode()
    service_url = re.search(r'href="(/policy/services/[0-9a-f-]+)"', policy).group(1)
    version = re.search(r'name="version" value="([^"]+)"', browser.get(service_url).content.decode()).group(1)
    refused = browser.post(f"{service_url}/delete", {"version": version, "confirm": "yes"})
    assert refused.status_code == 409 and "Still referenced" in text(refused) and "web" in text(refused)


def test_minting_shows_the_secret_once_and_revoking_works(browser):
    minted = text(browser.post("/tokens", {"kind": "operator", "name": "ci"}))
    secret = re.search(r"(pal_op_[A-Za-z0-9_\-]+)", minted).group(1)
    listing = text(browser.get("/tokens"))
    assert secret not in listing and secret[:12] in listing
    token_id = re.search(
        r"/tokens/operator/([0-9a-f-]+)/revoke", browser.get("/tokens").content.decode()
    ).group(1)
    assert "Revoked" in text(browser.post(f"/tokens/operator/{token_id}/revoke", {"confirm": "yes"}))


def test_a_cross_origin_post_from_a_browser_is_refused(browser):
    workload = make_workload(hostname="web-1")
    refused = browser.post(
        f"/workloads/{workload.id}/labels",
        {"labels": "a=b", "version": "1"},
        headers={"Sec-Fetch-Site": "cross-site"},
    )
    assert refused.status_code == 403
    assert browser.post("/logout", headers={"Origin": "https://evil.example"}).status_code == 403


def test_what_operators_typed_is_shown_escaped(browser):
    created = browser.post(
        "/policy/rulesets/new", {"name": "xss", "description": '<img src=x onerror="alert(1)">', "scope": ""}
    )
    page = browser.get(created["Location"]).content.decode()
    assert "<img src=x" not in page and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page


def test_the_dry_run_names_the_workloads_and_rules_that_would_change(browser):
    make_workload(hostname="web-1", labels={"app": "web"}, mode="simulation")
    created = browser.post("/policy/rulesets/new", {"name": "web", "scope": "app=web", "enabled": "on"})
    page = text(
        browser.post(
            f"{created['Location']}/rules/new", {"sources": "any", "services": "tcp/443", "action": "dryrun"}
        )
    )
    assert "1 workload would change" in page and "web-1" in page and "this new rule" in page
    assert "Nothing was saved" in page
    assert "No rule yet" in text(browser.get(created["Location"]))  # and nothing was


def test_mode_change_preview_by_ids_names_them_however_large_the_fleet(browser):
    wanted = make_workload(hostname="zz-last")
    for index in range(3):
        make_workload(hostname=f"aa-{index}")
    page = text(browser.get("/mode-changes", {"workloads": str(wanted.id), "mode": "simulation"}))
    assert "1 workload selected" in page and "zz-last" in page and "aa-0" not in page
    missing = text(browser.get("/mode-changes", {"workloads": "nope", "mode": "simulation"}))
    assert "&#x27;nope&#x27; is not a workload id" in missing or "'nope' is not a workload id" in missing, (
        missing
    )


def test_a_provisioning_token_is_minted_with_its_bundle_shown_once(browser):
    minted = browser.post(
        "/tokens",
        {"kind": "provisioning", "description": "rack 4", "max_uses": "3", "labels": "env=prod\nzone=a"},
    )
    page = minted.content.decode()
    bundle = re.search(r'<textarea id="secret"[^>]*>([^<]+)</textarea>', page).group(1).strip()
    assert bundle.startswith("palisade-enrol-v1:") and "palisade-agent enrol --bundle-file" in page
    assert minted["Cache-Control"] == "no-store"
    listing = text(browser.get("/tokens"))
    assert "rack 4" in listing and bundle not in listing and "0 / 3" in listing
    refused = text(browser.post("/tokens", {"kind": "provisioning", "description": "", "max_uses": "0"}))
    assert 'data-problem="validation"' in refused
    # "²" is a digit to str.isdigit but not to int: refused as text, not a 500.
    superscript = browser.post("/tokens", {"kind": "provisioning", "description": "x", "max_uses": "²"})
    assert superscript.status_code == 422 and 'data-problem="validation"' in text(superscript)
    unreadable = text(browser.post("/tokens", {"kind": "provisioning", "description": "x", "labels": "env"}))
    assert "env&#x27; is not key=value" in unreadable and 'data-problem="validation"' in unreadable


def test_a_token_for_a_workload_is_minted_and_listed_with_its_workload(browser):
    workload = make_workload(hostname="web-9")
    browser.post("/tokens", {"kind": "provisioning", "description": "general"})
    minted = browser.post(
        "/tokens", {"kind": "provisioning", "description": "rebuild web-9", "workload_id": str(workload.id)}
    )
    assert minted.status_code == 200 and "palisade-enrol-v1:" in minted.content.decode()
    page = browser.get("/tokens").content.decode()
    assert f're-enrols <a href="/workloads/{workload.id}">' in page and "new workloads" in page
    refused = browser.post("/tokens", {"kind": "provisioning", "description": "x", "workload_id": "nope"})
    assert refused.status_code == 422 and "No workload" in text(refused)


def test_a_workload_s_credential_is_revoked_from_its_page_after_a_confirmation(browser):
    from fleet.models import Workload

    workload = make_workload(hostname="web-8")
    page = text(browser.get(f"/workloads/{workload.id}"))
    assert "Revoke credential" in page
    asked = browser.post(f"/workloads/{workload.id}/revoke-credential", {"reason": "key stolen"})
    asked_text = text(asked)
    assert asked.status_code == 200 and "data-confirm" in asked.content.decode()
    assert "Revoke the credential of web-8" in asked_text and "key stolen" in asked_text
    assert Workload.objects.get(id=workload.id).credential_revoked_at is None
    refused = browser.post(
        f"/workloads/{workload.id}/revoke-credential", {"reason": "x" * 1001, "confirm": "yes"}
    )
    assert refused.status_code == 422 and 'data-problem="validation"' in text(refused)
    done = text(
        browser.post(
            f"/workloads/{workload.id}/revoke-credential", {"reason": "key stolen", "confirm": "yes"}
        )
    )
    assert "Credential revoked at" in done
    page = text(browser.get(f"/workloads/{workload.id}"))
    assert "Credential revoked" in page and "key stolen" in page and "minted for it" in page


def test_the_review_page_says_when_a_list_shows_only_the_first_of_many(browser, monkeypatch):
    from flows import selectors

    monkeypatch.setattr(selectors, "COVERAGE_LIST", 1)
    make_workload(hostname="never-1")
    make_workload(hostname="never-2")
    page = text(browser.get("/review?range=1h"))
    assert "2 workloads are offline" in page and "Showing the first 1 of 2." in page


def test_the_flows_page_names_a_workload_gone_silent(browser):
    """A dead agent's silence has no gap until it reports again: the coverage line says who and since."""
    from datetime import timedelta

    from controlplane import clock
    from fleet.models import Workload

    workload = make_workload(hostname="gone-quiet")
    Workload.objects.filter(id=workload.id).update(
        last_flow_report_at=clock.now() - timedelta(minutes=10), flow_window_seconds=60
    )
    page = text(browser.get("/flows?range=1h"))
    assert "Incomplete:" in page and "1 silent since before its end (" in page, page
    assert f'<a href="/workloads/{workload.id}">gone-quiet</a> since' in page


def _version(response) -> str:
    return re.search(r'name="version" value="([^"]+)"', response.content.decode()).group(1)


def test_deleting_a_ruleset_asks_first_naming_its_rules_and_the_workloads_it_protects(browser):
    for index, mode in enumerate(("enforced", "enforced", "simulation")):
        make_workload(hostname=f"web-{index}", labels={"app": "web"}, mode=mode)
    make_workload(hostname="db-1", labels={"app": "db"}, mode="enforced")
    url = browser.post("/policy/rulesets/new", {"name": "web", "scope": "app=web", "enabled": "on"})[
        "Location"
    ]
    for port in ("tcp/443", "tcp/80"):
        browser.post(f"{url}/rules/new", {"sources": "any", "services": port, "action": "save"})
    ruleset_page = browser.get(url).content.decode()
    assert "hx-confirm" not in ruleset_page and f'href="{url}/delete"' in ruleset_page
    asked = browser.get(f"{url}/delete")
    page = text(asked)
    assert asked.status_code == 200
    assert "Delete ruleset “web”: its 2 rules go, and it protects 3 workloads now." in page, page
    assert "2 enforced workloads: connections that only these rules admit are blocked" in page
    assert "1 workload in simulation" in page and f'href="{url}">Cancel</a>' in page
    unconfirmed = browser.post(f"{url}/delete", {"version": _version(asked)})  # no confirm: asks again
    assert unconfirmed.status_code == 200 and "its 2 rules go" in text(unconfirmed)
    assert browser.get(url).status_code == 200
    done = browser.post(f"{url}/delete", {"version": _version(asked), "confirm": "yes"})
    assert done.status_code == 302 and browser.get(url).status_code == 404


def test_deleting_a_rule_a_service_and_an_address_group_asks_first(browser):
    make_workload(hostname="web-0", labels={"app": "web"}, mode="enforced")
    browser.post("/policy/services/new", {"name": "https", "text": "tcp/443"})
    browser.post("/policy/address-groups/new", {"name": "office", "text": "10.1.0.0/16"})
    url = browser.post("/policy/rulesets/new", {"name": "web", "scope": "app=web", "enabled": "on"})[
        "Location"
    ]
    browser.post(f"{url}/rules/new", {"description": "admin", "sources": "group:office", "services": "tcp/22",
                                      "action": "save"})  # fmt: skip
    rule_url = re.search(
        r'href="(/policy/rulesets/[^"]+/rules/[0-9a-f-]+)/delete"', browser.get(url).content.decode()
    )
    asked = browser.get(f"{rule_url.group(1)}/delete")
    page = text(asked)
    assert "Delete rule 1 (admin) of ruleset “web”, which admits group:office to tcp/22" in page, page
    assert "protects 1 workload now" in page and "1 enforced workload:" in page
    assert "admin" in text(browser.get(url))  # asking changed nothing
    assert (
        browser.post(
            f"{rule_url.group(1)}/delete", {"version": _version(asked), "confirm": "yes"}
        ).status_code
        == 302
    )
    assert "No rule yet" in text(browser.get(url))
    policy = browser.get("/policy").content.decode()
    for kind, name, listed in (("services", "https", "tcp/443"), ("address-groups", "office", "10.1.0.0/16")):
        object_url = re.search(rf'href="(/policy/{kind}/[0-9a-f-]+)">{name}<', policy).group(1)
        assert f'href="{object_url}/delete"' in browser.get(object_url).content.decode()
        asked = browser.get(f"{object_url}/delete")
        assert f"“{name}” ({listed})" in text(asked)
        assert browser.get(object_url).status_code == 200
        done = browser.post(f"{object_url}/delete", {"version": _version(asked), "confirm": "yes"})
        assert done.status_code == 302 and browser.get(object_url).status_code == 404


def test_revoking_a_token_asks_first_and_the_token_works_until_confirmed(browser, client):
    secret = re.search(
        r"(pal_op_[A-Za-z0-9_\-]+)", text(browser.post("/tokens", {"kind": "operator", "name": "ci"}))
    ).group(1)
    browser.post("/tokens", {"kind": "provisioning", "description": "rack 4", "max_uses": "3"})
    listing = browser.get("/tokens").content.decode()
    assert "hx-confirm" not in listing
    for kind, named in (("operator", "“ci”"), ("provisioning", "“rack 4”, used 0 of 3 times")):
        token_id = re.search(rf"/tokens/{kind}/([0-9a-f-]+)/revoke", listing).group(1)
        asked = text(browser.get(f"/tokens/{kind}/{token_id}/revoke"))
        assert f"Revoke {kind} token pal_" in asked and named in asked, asked
        assert "Revoked" not in text(browser.post(f"/tokens/{kind}/{token_id}/revoke"))  # no confirm: asks
    bearer = {"HTTP_AUTHORIZATION": f"Bearer {secret}"}
    assert client.get("/api/v1/me", **bearer).status_code == 200
    token_id = re.search(r"/tokens/operator/([0-9a-f-]+)/revoke", listing).group(1)
    assert "Revoked" in text(browser.post(f"/tokens/operator/{token_id}/revoke", {"confirm": "yes"}))
    assert client.get("/api/v1/me", **bearer).status_code == 401


def test_mode_change_preview_and_convergence_cover_a_fleet_larger_than_a_page(browser):
    from fleet.models import Workload

    Workload.objects.bulk_create(
        [Workload(hostname=f"aa-{index:04}", labels={"env": "lab"}, addresses=[], public_key="k" * 44,
                  credential_issued_at=clock_now(), credential_expires_at=clock_now(), enrolled_at=clock_now())
         for index in range(520)]
    )  # fmt: skip
    named = [make_workload(hostname=f"zz-{index}", labels={"env": "lab"}) for index in range(3)]
    other = make_workload(hostname="zz-other", labels={"env": "dev"})
    ids = "\n".join(str(w.id) for w in named + [other])
    page = text(browser.get("/mode-changes", {"labels": "env=lab", "workloads": ids, "mode": "simulation"}))
    assert "3 workloads selected" in page and all(f"zz-{i}<" in page for i in range(3)), page[-3000:]
    assert (
        f"Named but not selected (no such workload, or its labels do not meet the requirements): <code>{other.id}</code>"
        in page
    )
    everything = text(browser.get("/mode-changes", {"labels": "env=lab", "mode": "simulation"}))
    assert "523 workloads selected" in everything and "Showing the first 200 of 523." in everything
    polled = text(browser.get("/mode-changes/convergence", {"labels": "env=lab", "workloads": ids}))
    assert 'data-selected="3"' in polled and all(f"zz-{i}<" in polled for i in range(3))
    polled = text(browser.get("/mode-changes/convergence", {"labels": "env=lab"}))
    assert 'data-selected="523"' in polled and "Showing the first 200 of 523." in polled


def clock_now():
    from controlplane import clock

    return clock.now()


def _minute_windows(count: int):
    """`count` one-minute windows ending before now, each with one observed connection from a peer
    of its own."""
    from datetime import timedelta

    from tests.support.flow_evidence import windows_between

    windows = windows_between(clock_now() - timedelta(minutes=count + 2), count)
    for index, window in enumerate(windows):
        window["groups"][0]["peer"] = f"10.60.{index // 250}.{index % 250 + 1}"
    return windows


def test_the_plots_cover_a_range_of_more_windows_than_a_page(browser):
    from flows.services import flow_report_ingest
    from tests.support.flow_evidence import enrolled, flow_report

    web, _, _ = enrolled("web", "10.50.0.1")
    answer = flow_report_ingest(workload_id=str(web.id), data=flow_report("p1", 100, _minute_windows(600)))
    assert all(r["result"] == "accepted" for r in answer["windows"])
    for url in (f"/workloads/{web.id}?range=24h", f"/flows?range=24h&workloads={web.id}"):
        page = browser.get(url).content.decode()
        assert '<span data-total="observed">600</span>' in page, url
        assert page.count('class="bar bar-observed"') == 600 and "data-plot-cut" not in page


def test_the_plot_says_where_it_stops_when_a_range_has_more_rows_than_it_reads(browser, monkeypatch):
    from controlplane.console import client
    from controlplane.console.views import evidence
    from flows.services import flow_report_ingest
    from tests.support.flow_evidence import enrolled, flow_report

    monkeypatch.setattr(evidence, "PLOT_ROWS", 10)
    monkeypatch.setattr(client, "PAGE_LIMIT", 5)
    web, _, _ = enrolled("web", "10.50.0.1")
    flow_report_ingest(workload_id=str(web.id), data=flow_report("p1", 100, _minute_windows(30)))
    page = text(browser.get(f"/flows?range=24h&workloads={web.id}"))
    assert "the plot and its totals stop at the window of" in page


def test_the_csv_exports_hold_every_row_in_the_shape_of_manage_py_flows(browser):
    import csv
    import io
    import uuid
    from datetime import timedelta

    from controlplane import clock
    from flows.models import EvidenceGap
    from flows.partitions import flow_partitions_ensure
    from flows.services import flow_report_ingest
    from tests.support.flow_evidence import enrolled, flow_report
    from tests.support.helpers import run_command

    web, _, _ = enrolled("web", "10.50.0.1")
    flow_report_ingest(workload_id=str(web.id), data=flow_report("p1", 100, _minute_windows(600)))
    now = clock.now()
    # Stored here without a report, which would make their days' partitions: between 10:00 and 11:40
    # UTC the first gaps end yesterday, a day no window of the report above lies in.
    flow_partitions_ensure(days={(now - timedelta(minutes=700)).date(), now.date()})
    EvidenceGap.objects.bulk_create(
        [EvidenceGap(id=uuid.uuid4(), workload=web, kind="buffer_overflow", source="agent",
                     start=now - timedelta(minutes=700 - i), end=now - timedelta(minutes=699 - i),
                     lost={"windows": 1}, received_at=now) for i in range(510)]
    )  # fmt: skip
    query = f"range=24h&workloads={web.id}&group_by=peer&group_by=decision"
    page = text(browser.get(f"/flows?{query}"))
    assert "Showing the first 500 gaps only; there are more: the CSV export has every one." in page
    rollup = browser.get(f"/flows?{query}&export=rollup")
    rows = list(csv.DictReader(io.StringIO(rollup.content.decode())))
    assert len(rows) == 600 and sum(int(r["connection_count"]) for r in rows) == 600
    gaps = browser.get(f"/flows?{query}&export=gaps").content.decode()
    assert len(list(csv.DictReader(io.StringIO(gaps)))) == 510
    start = (now - timedelta(hours=24)).strftime("%Y-%m-%dT%H:%M:%SZ")
    end = (now + timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    _, cli_gaps, _ = run_command(
        "flows", "gaps", "--workload", str(web.id), "--from", start, "--to", end, "--csv"
    )
    assert (
        cli_gaps.splitlines()[0] == gaps.splitlines()[0] and cli_gaps.splitlines()[1] == gaps.splitlines()[1]
    )
    assert '"{""windows"": 1}"' in gaps.splitlines()[1]
    _, cli_rollup, _ = run_command("flows", "rollup", "--workload", str(web.id), "--group-by", "peer",
                                   "--group-by", "decision", "--from", start, "--to", end, "--csv")  # fmt: skip
    assert cli_rollup.splitlines() == rollup.content.decode().splitlines()


def test_an_agents_control_characters_and_bidi_overrides_are_shown_escaped(browser):
    """HTML escaping leaves ESC and U+202E alone: text stored raw (before ingestion escaped it) of a
    workload's version, apply error, renewal error and gaps is shown with them escaped."""
    import uuid
    from datetime import timedelta

    from controlplane import clock
    from fleet.models import Workload
    from flows.models import EvidenceGap
    from flows.partitions import flow_partitions_ensure
    from tests.support.hostile_text import HOSTILE, assert_shown_harmlessly

    storable = [text for text in HOSTILE if "\x00" not in text and "\ud800" not in text]  # PostgreSQL's
    workload = connect(make_workload(hostname="odd-1"))
    Workload.objects.filter(id=workload.id).update(
        agent_version="".join(storable)[:64],
        applied_version=storable[5],
        sync_state="degraded",
        sync_error="".join(storable),
        credential_renewal_failed=True,
        credential_last_error="".join(storable),
    )
    now = clock.now()
    flow_partitions_ensure(days={(now - timedelta(minutes=5)).date(), now.date()})  # also just after midnight
    EvidenceGap.objects.create(
        id=uuid.uuid4(), workload_id=workload.id, kind="window_overflow", start=now - timedelta(minutes=5),
        end=now - timedelta(minutes=4), lost=dict.fromkeys(storable, 1), received_at=now,
    )  # fmt: skip
    for path in (f"/workloads/{workload.id}", "/", "/flows?range=1h", "/review?range=1h"):
        response = browser.get(path)
        assert response.status_code == 200, path
        assert_shown_harmlessly(response.content.decode(), layout="\n\t")
    assert "\\u202eevil" in text(browser.get(f"/workloads/{workload.id}"))


def test_a_deny_rule_is_chosen_in_the_form_and_shown_as_deny_wherever_rules_are_listed(browser):
    workload = make_workload(hostname="db-1", labels={"app": "db"}, mode="enforced")
    created = browser.post("/policy/rulesets/new", {"name": "blocklist", "scope": "app=db", "enabled": "on"})
    ruleset_url = created["Location"]
    everything = "tcp/1-65535\nudp/1-65535\nicmp\nicmpv6"
    dryrun = text(browser.post(f"{ruleset_url}/rules/new", {"rule_action": "deny", "sources": "any",
                                                             "services": everything, "action": "dryrun"}))  # fmt: skip
    assert "refuses every connection the workloads of &#x27;app=db&#x27; receive" in dryrun
    bad = browser.post(f"{ruleset_url}/rules/new", {"rule_action": "drop", "sources": "any", "services": "tcp/23", "action": "save"})  # fmt: skip
    assert bad.status_code == 422 and 'id="action-errors"' in bad.content.decode()
    for services in ("tcp/23", everything):
        saved = browser.post(f"{ruleset_url}/rules/new", {"rule_action": "deny", "sources": "any", "services": services, "action": "save"})  # fmt: skip
        assert saved.status_code == 302
    browser.post(
        f"{ruleset_url}/rules/new", {"sources": "role=client", "services": "tcp/5432", "action": "save"}
    )
    page = browser.get(ruleset_url).content.decode()
    assert page.count('data-action="deny"') == 2 and page.count('data-action="allow"') == 1
    assert page.count('data-warning="deny-refuses-everything"') == 1
    assert (
        '<span class="chip chip-bad" data-action="deny">2 deny</span>'
        in browser.get("/policy").content.decode()
    )
    edit_url = re.search(r'href="(/policy/rulesets/[0-9a-f-]+/rules/[0-9a-f-]+)"', page).group(1)
    assert '<option value="deny" selected>' in browser.get(edit_url).content.decode()
    assert browser.get(f"/workloads/{workload.id}").content.decode().count('data-action="deny"') == 2


def test_flows_and_rule_hits_mark_what_a_deny_rule_refused(browser):
    from flows.services import flow_report_ingest
    from tests.support.flow_evidence import enrolled, flow_report

    created = browser.post("/policy/rulesets/new", {"name": "blocklist", "scope": "", "enabled": "on"})
    saved = browser.post(f"{created['Location']}/rules/new",
                         {"rule_action": "deny", "sources": "any", "services": "tcp/23", "action": "save"})  # fmt: skip
    assert saved.status_code == 302
    page = browser.get(created["Location"]).content.decode()
    number = int(re.search(r"<tr class=\"deny-rule\"><td>(\d+)</td>", page).group(1))
    web, _, _ = enrolled("web", "10.50.0.1")
    windows = _minute_windows(1)
    windows[0]["groups"][0].update(peer="10.66.0.1", port=23, decision="blocked", rule=number)
    answer = flow_report_ingest(workload_id=str(web.id), data=flow_report("p1", 100, windows))
    assert all(r["result"] == "accepted" for r in answer["windows"])
    workload_page = browser.get(f"/workloads/{web.id}?range=1h").content.decode()
    assert re.search(
        rf"<td>{number} <span class=\"chip chip-bad\" data-action=\"deny\">deny</span></td>", workload_page
    )
    flows_page = browser.get("/flows?range=1h&group_by=rule").content.decode()
    assert flows_page.count(f'{number} <span class="chip chip-bad" data-action="deny">deny</span>') == 1
    hits = flows_page[flows_page.index('id="rules-h"') :]
    assert 'data-action="deny">deny</span>' in hits

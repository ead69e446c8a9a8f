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
    refused = browser.post(f"{service_url}/delete", {"version": version})
    assert refused.status_code == 409 and "Still referenced" in text(refused) and "web" in text(refused)


def test_minting_shows_the_secret_once_and_revoking_works(browser):
    minted = text(browser.post("/tokens", {"kind": "operator", "name": "ci"}))
    secret = re.search(r"(pal_op_[A-Za-z0-9_\-]+)", minted).group(1)
    listing = text(browser.get("/tokens"))
    assert secret not in listing and secret[:12] in listing
    token_id = re.search(
        r"/tokens/operator/([0-9a-f-]+)/revoke", browser.get("/tokens").content.decode()
    ).group(1)
    assert "Revoked" in text(browser.post(f"/tokens/operator/{token_id}/revoke"))


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
    assert "No workload nope" in missing


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


def test_a_workload_s_credential_is_revoked_from_its_page(browser):
    workload = make_workload(hostname="web-8")
    page = text(browser.get(f"/workloads/{workload.id}"))
    assert (
        "Revoke credential" in page
        and "hx-confirm" in browser.get(f"/workloads/{workload.id}").content.decode()
    )
    refused = browser.post(f"/workloads/{workload.id}/revoke-credential", {"reason": "x" * 1001})
    assert refused.status_code == 422 and 'data-problem="validation"' in text(refused)
    done = text(browser.post(f"/workloads/{workload.id}/revoke-credential", {"reason": "key stolen"}))
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

"""The console's webhook pages in-process (Django's test client), through the operator API only: the
list with each backlog, creation with the signing secret shown once, the API's findings beside the
fields, a webhook's recent deliveries, and deleting after a confirmation step. The browser test
(test_console_in_browser.py) drives the same pages in Chromium against the real serve."""

from __future__ import annotations

import re

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db

RECEIVER = "http://127.0.0.1:9/hook"  # loopback: admitted over plain http on a port listed as a receiver's


@pytest.fixture(autouse=True)
def receiver_port_listed(settings):
    settings.PALISADE_WEBHOOK_LOOPBACK_PORTS = (9,)


@pytest.fixture
def browser(operator_password):
    client = Client()
    response = client.post("/login", {"password": operator_password, "next": "/webhooks"})
    assert response.status_code == 302 and response["Location"] == "/webhooks"
    return client


def text(response) -> str:
    return re.sub(r"\s+", " ", response.content.decode())


def _create(browser, **fields):
    form = {"url": RECEIVER, "events": ["webhook.created", "workload.offline"], "description": "pager"}
    return browser.post("/webhooks", {**form, **fields})


def _webhook_id(browser) -> str:
    return re.search(r'data-webhook="([0-9a-f-]+)"', browser.get("/webhooks").content.decode()).group(1)


def test_the_page_offers_every_event_type_the_api_admits_and_has_a_strict_policy(browser, client):
    response = browser.get("/webhooks")
    assert response.status_code == 200
    assert 'aria-current="page">Webhooks</a>' in response.content.decode()
    schema = client.get("/api/v1/schema?format=json", HTTP_COOKIE=browser.cookies.output(header="", sep=";"))
    admitted = schema.json()["components"]["schemas"]["EventsEnum"]["enum"]
    offered = re.findall(r'name="events" value="([^"]+)"', response.content.decode())
    assert offered == admitted and "webhook.deleted" in offered
    policy = response["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy
    assert "<script>" not in response.content.decode() and " style=" not in response.content.decode()


def test_creating_shows_the_secret_once_and_lists_the_webhook_with_its_backlog(browser, client):
    created = _create(browser)
    assert created.status_code == 200, text(created)[:2000]
    shown = text(created)
    secret = re.search(
        r'<textarea id="secret" readonly rows="1" aria-label="The secret">(whsec_[^<]+)<', shown
    )
    assert secret and "copy it now, it is not shown again" in shown
    listing = browser.get("/webhooks")
    page = text(listing)
    assert secret.group(1) not in page and "copy it now" not in page
    row = re.search(r'<tr data-webhook="[^"]+">(.*?)</tr>', page).group(1)
    # Subscribed to webhook.created: its own creation is its first pending delivery.
    assert RECEIVER in row and "webhook.created" in row and "workload.offline" in row and "pager" in row
    assert re.search(r"<td>1 \(since [0-9-]+ [0-9:]+\)</td>", row), row
    webhook_id = _webhook_id(browser)
    assert secret.group(1) not in browser.get(f"/webhooks/{webhook_id}").content.decode()


def test_the_api_s_findings_are_shown_beside_their_fields_and_nothing_is_created(browser):
    refused = _create(browser, url="ftp://example.com/x", events=[], description="kept")
    page = text(refused)
    assert refused.status_code == 422 and 'data-problem="validation"' in page
    url_errors = re.search(r'<ul class="field-errors" id="url-errors">(.*?)</ul>', page).group(1)
    events_errors = re.search(r'<ul class="field-errors" id="events-errors">(.*?)</ul>', page).group(1)
    assert "https" in url_errors and "events" in events_errors
    assert 'value="ftp://example.com/x"' in page and 'value="kept"' in page  # what was typed stays
    assert "None yet." in page and "whsec_" not in page
    again = text(_create(browser, url="https://192.0.2.10/x", events=["workload.offline", "bogus"]))
    assert 'value="workload.offline" checked' in again and "bogus" in again


def test_a_webhook_s_page_lists_its_recent_deliveries(browser, settings):
    from controlplane.webhooks.sender import Answer, webhook_deliveries_send

    settings.PALISADE_WEBHOOK_RETRY_BASE_SECONDS = 600
    _create(browser)
    webhook_id = _webhook_id(browser)
    assert "No attempt yet." in text(browser.get(f"/webhooks/{webhook_id}"))
    webhook_deliveries_send(post=lambda url, **_: Answer(503, "HTTP 503: busy", 12))
    page = text(browser.get(f"/webhooks/{webhook_id}"))
    attempt = re.search(r'<tr data-attempt="[^"]+" data-outcome="retrying">(.*?)</tr>', page).group(1)
    cells = re.findall(r"<td>(.*?)</td>", attempt)
    assert "webhook.created" in cells[1] and cells[2:6] == ["1", "retrying", "503", "HTTP 503: busy"]
    assert re.fullmatch(r"[0-9-]+ [0-9:]+", cells[0]) and re.fullmatch(r"[0-9-]+ [0-9:]+", cells[6])
    assert "Pending deliveries</dt><dd>1 (the oldest since" in page
    assert browser.get("/webhooks/00000000-0000-0000-0000-000000000000").status_code == 404
    assert browser.get("/webhooks/not-an-id").status_code == 404


def test_deleting_asks_first_and_only_the_confirmation_deletes(browser, client):
    _create(browser, description="the pager")
    webhook_id = _webhook_id(browser)
    assert "hx-confirm" not in browser.get("/webhooks").content.decode()
    asked = text(browser.get(f"/webhooks/{webhook_id}/delete"))
    assert f"Delete the webhook to {RECEIVER} (“the pager”)" in asked
    assert "1 pending delivery to it and its delivery history are deleted" in asked
    assert f'<a class="button secondary" href="/webhooks/{webhook_id}">Cancel</a>' in asked
    unconfirmed = text(browser.post(f"/webhooks/{webhook_id}/delete"))  # no confirm: asks again
    assert "Deleted." not in unconfirmed and "Delete the webhook to" in unconfirmed
    assert browser.get(f"/webhooks/{webhook_id}").status_code == 200
    done = text(browser.post(f"/webhooks/{webhook_id}/delete", {"confirm": "yes"}))
    assert "Deleted." in done and "None yet." in done
    assert browser.get(f"/webhooks/{webhook_id}").status_code == 404
    assert browser.get(f"/webhooks/{webhook_id}/delete").status_code == 404


def test_texts_from_the_api_and_receivers_are_shown_escaped(browser):
    from controlplane.webhooks.models import Webhook, WebhookAttempt
    from controlplane.webhooks.sender import Answer, webhook_deliveries_send
    from tests.support.hostile_text import HOSTILE, assert_shown_harmlessly

    storable = "".join(t for t in HOSTILE if "\x00" not in t and "\ud800" not in t)  # PostgreSQL's
    _create(browser, description='<img src=x onerror="alert(1)">')
    webhook_id = _webhook_id(browser)
    webhook_deliveries_send(post=lambda url, **_: Answer(None, "refused " + storable, 3))
    assert WebhookAttempt.objects.filter(webhook_id=webhook_id).exists()
    # Stored raw, as no API input admits it: the page must still show it harmlessly.
    Webhook.objects.filter(id=webhook_id).update(url=RECEIVER + "\u202eevil", description=storable)
    WebhookAttempt.objects.filter(webhook_id=webhook_id).update(error="refused " + storable)
    for path in ("/webhooks", f"/webhooks/{webhook_id}", f"/webhooks/{webhook_id}/delete"):
        response = browser.get(path)
        assert response.status_code == 200, path
        assert_shown_harmlessly(response.content.decode(), layout="\n\t")
        assert "\\u202eevil" in response.content.decode(), path
    Webhook.objects.filter(id=webhook_id).update(description='<img src=x onerror="alert(1)">')
    page = browser.get("/webhooks").content.decode()
    assert "<img src=x" not in page and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page


def test_a_delivery_given_up_unsent_shows_no_attempt_number_and_our_reason(browser, settings):
    from controlplane.housekeeping import webhooks_cap_step

    _create(browser, events=["webhook.created", "webhook.deleted"])
    webhook_id = _webhook_id(browser)
    _create(browser, url="http://127.0.0.1:9/other", events=["workload.offline"])  # its creation: news
    settings.PALISADE_WEBHOOK_MAX_PENDING = 1
    assert webhooks_cap_step() == 1
    page = text(browser.get(f"/webhooks/{webhook_id}"))
    attempt = re.search(r'<tr data-attempt="[^"]+" data-outcome="gave_up">(.*?)</tr>', page).group(1)
    cells = re.findall(r"<td>(.*?)</td>", attempt)
    assert cells[2:6] == [
        "—",
        "gave up",
        "—",
        "given up unsent: over 1 pending deliveries to this webhook, the oldest go",
    ]

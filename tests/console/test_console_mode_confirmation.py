"""The console's mode changes with confirmation, in process: "with confirmation" on the mode-change
page, the countdown and the Confirm button (and every change awaiting confirmation listed there), the
settled states, and the API's refusals in words. The browser test (test_console_in_browser.py) drives
the countdown and Confirm in Chromium against the real serve."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client

from controlplane.auth.actor import CLI_ACTOR
from fleet.mode_confirmations import mode_changes_revert_due
from fleet.models import ModeChange, Workload
from fleet.services import mode_change_create
from tests.support.workloads import make_workload

pytestmark = pytest.mark.django_db
HTMX = {"HX-Request": "true"}


@pytest.fixture
def browser(operator_password):
    client = Client()
    assert client.post("/login", {"password": operator_password}).status_code == 302
    return client


def text(response) -> str:
    return re.sub(r"\s+", " ", response.content.decode())


def enforce(workload, within=300):
    return mode_change_create(
        actor=CLI_ACTOR,
        data={
            "selection": {"workload_ids": [str(workload.id)]},
            "mode": "enforced",
            "confirm_within_seconds": within,
        },
    )


def seconds_left(page: str) -> int:
    return int(re.search(r'data-seconds-left="(\d+)"', page)[1])


def test_enforce_with_confirmation_counts_down_and_confirm_settles_it(browser):
    web = make_workload(hostname="web-1", labels={"app": "web"}, mode="simulation")
    form = {
        "workloads": str(web.id),
        "mode": "simulation",
        "with_confirmation": "yes",
        "confirm_within": "120",
    }
    page = text(browser.post("/mode-changes", form))
    change = ModeChange.objects.get()
    assert change.confirm_by - change.created_at == timedelta(seconds=120)
    assert f'data-mode-change="{change.id}" data-confirmation="awaiting"' in page
    assert 115 <= seconds_left(page) <= 120 and re.search(r">(2 min 0 s|1 min 5\d s)<", page)
    assert f'hx-get="/mode-changes/{change.id}" hx-trigger="every 1s"' in page  # the countdown polls
    assert f'action="/mode-changes/{change.id}/confirm"' in page and ">Confirm</button>" in page

    polled = browser.get(f"/mode-changes/{change.id}", headers=HTMX)
    assert "<html" not in polled.content.decode() and 'data-confirmation="awaiting"' in text(polled)
    confirmed = browser.post(f"/mode-changes/{change.id}/confirm", headers=HTMX)
    assert confirmed.status_code == 200
    settled = text(confirmed)
    assert 'data-confirmation="confirmed"' in settled and "stands" in settled
    assert "hx-trigger" not in settled  # settled: the polling stops
    assert Workload.objects.get(id=web.id).mode == "simulation"
    assert ModeChange.objects.get(id=change.id).confirmed_at is not None


def test_every_change_awaiting_confirmation_is_on_the_mode_change_page(browser):
    web = make_workload(hostname="web-1", mode="simulation")
    made_elsewhere = enforce(web)
    page = text(browser.get("/mode-changes"))
    assert "Awaiting confirmation" in page and f'data-mode-change="{made_elsewhere.id}"' in page
    other = make_workload(hostname="db-1", mode="simulation")
    made_here = text(
        browser.post(
            "/mode-changes",
            {
                "workloads": str(other.id),
                "mode": "simulation",
                "with_confirmation": "yes",
                "confirm_within": "60",
            },
        )
    )
    assert made_here.count(f'data-mode-change="{made_elsewhere.id}"') == 1
    made = ModeChange.objects.exclude(id=made_elsewhere.id).get()
    assert made_here.count(f'data-mode-change="{made.id}"') == 1  # once, beside its notice
    browser.post(f"/mode-changes/{made_elsewhere.id}/confirm")
    assert f'data-mode-change="{made_elsewhere.id}"' not in text(browser.get("/mode-changes"))


def test_a_change_put_back_shows_the_revert_and_a_late_confirmation_is_refused_in_words(browser, clock_at):
    web = make_workload(hostname="web-1", mode="simulation")
    change = enforce(web, within=10)
    clock_at(timedelta(seconds=11))
    due = text(browser.get(f"/mode-changes/{change.id}", headers=HTMX))
    assert "is being put back" in due and "hx-trigger" in due  # until the revert has run
    mode_changes_revert_due()
    revert = ModeChange.objects.get(reverts=change)
    page = text(browser.get(f"/mode-changes/{change.id}"))
    assert 'data-confirmation="reverted"' in page and f'href="/mode-changes/{revert.id}"' in page
    assert "moved 1 workload back to the mode each had before" in page
    late = browser.post(f"/mode-changes/{change.id}/confirm")
    assert late.status_code == 409
    assert 'data-problem="confirmation-deadline-passed"' in text(late)
    assert (
        browser.post(f"/mode-changes/{change.id}/confirm", headers=HTMX).status_code == 200
    )  # HTMX swaps it in
    reverted = text(browser.get(f"/mode-changes/{revert.id}"))
    assert f"Mode change {change.id} was not confirmed by" in reverted and "Put back" in reverted
    assert "<td>enforced</td><td>simulation</td>" in reverted.replace(" ", "")
    response = browser.get(f"/mode-changes/{revert.id}")
    assert (
        "unsafe-inline" not in response["Content-Security-Policy"]
        and " style=" not in response.content.decode()
    )


def test_a_deadline_the_api_refuses_is_shown_with_its_finding(browser):
    web = make_workload(hostname="web-1")
    form = {"workloads": str(web.id), "mode": "simulation", "with_confirmation": "yes", "confirm_within": "5"}
    refused = browser.post("/mode-changes", form)
    assert refused.status_code == 200  # the form page; the refusal is in words under it
    page = text(refused)
    assert 'data-problem="validation"' in page and "/confirm_within_seconds" in page
    assert not ModeChange.objects.exists() and Workload.objects.get(id=web.id).mode == "visibility"


def test_an_unknown_mode_change_is_not_found(browser):
    assert browser.get("/mode-changes/00000000-0000-0000-0000-000000000000").status_code == 404
    assert browser.post("/mode-changes/not-an-id/confirm").status_code == 404

"""Outbound in the console: the outbound mode beside the mode and as a fleet filter, the mode-change page
with the direction, outbound rulesets with destinations in the rule forms, the fail-safe list on the
about page."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from fleet.models import Workload
from policy.models import Ruleset
from tests.support.workloads import make_workload

pytestmark = pytest.mark.django_db


@pytest.fixture
def browser(operator_password):
    client = Client()
    response = client.post("/login", {"password": operator_password, "next": "/"})
    assert response.status_code == 302
    return client


def text(response) -> str:
    return re.sub(r"\s+", " ", response.content.decode())


def test_the_outbound_mode_is_changed_shown_and_filtered(browser):
    web = make_workload(hostname="web-1", labels={"app": "web"})
    make_workload(hostname="db-1", labels={"app": "db"})
    done = browser.post("/mode-changes", {"labels": "app=web", "mode": "simulation", "direction": "outbound"})
    assert done.status_code == 200, text(done)
    assert "move to simulation outbound" in text(done)
    stored = Workload.objects.get(id=web.id)
    assert (stored.mode, stored.outbound_mode) == ("visibility", "simulation")
    fleet = text(browser.get("/"))
    assert 'data-chip="outbound-mode">outbound simulation' in fleet
    filtered = text(browser.get("/?outbound_mode=simulation"))
    assert "web-1" in filtered and "db-1" not in filtered
    assert "outbound simulation" in text(browser.get(f"/workloads/{web.id}"))


def test_an_outbound_change_to_enforced_is_gated_by_the_outbound_review(browser):
    """The workload simulates inbound throughout but its outbound mode is visibility: the outbound
    review fails (not in simulation), and the change needs the operator's confirmation."""
    from datetime import timedelta

    from controlplane import clock

    web = make_workload(hostname="web-1", labels={"app": "web"})
    long_ago = clock.now() - timedelta(days=2)
    Workload.objects.filter(id=web.id).update(mode="simulation", mode_since=long_ago, enrolled_at=long_ago)
    form = {"labels": "app=web", "mode": "enforced", "direction": "outbound"}
    asked = text(browser.post("/mode-changes", form))
    assert "the connections they open" in asked and "not in simulation" in asked
    assert Workload.objects.get(id=web.id).outbound_mode == "visibility"
    done = browser.post("/mode-changes", {**form, "confirm": "enforce-despite-review"})
    assert done.status_code == 200, text(done)
    assert Workload.objects.get(id=web.id).outbound_mode == "enforced"


def test_an_outbound_ruleset_is_created_and_its_rules_have_destinations(browser):
    created = browser.post("/policy/rulesets/new", {"name": "egress", "scope": "app=web", "direction": "outbound",
                                                    "enabled": "on"})  # fmt: skip
    assert created.status_code == 302, text(created)
    ruleset = Ruleset.objects.get(name="egress")
    assert ruleset.direction == "outbound"
    added = browser.post(f"/policy/rulesets/{ruleset.id}/rules/new",
                         {"sources": "group-less=1\nany", "services": "tcp/443", "rule_action": "allow"})  # fmt: skip
    assert added.status_code in (200, 302), text(added)
    page = text(browser.get(f"/policy/rulesets/{ruleset.id}"))
    assert "Destinations" in page and "tcp/443" in page
    saved = browser.post(f"/policy/rulesets/{ruleset.id}", {"name": "egress", "scope": "app=web",
                         "direction": "outbound", "enabled": "on", "version": f"{Ruleset.objects.get(id=ruleset.id).version}"})  # fmt: skip
    assert saved.status_code == 200 and "Saved." in text(saved), text(saved)


def test_the_about_page_shows_the_fail_safe_list(browser):
    page = text(browser.get("/about"))
    assert re.search(
        r'data-fact="outbound-failsafe"><code>udp/53</code>, <code>tcp/53</code>, <code>udp/123</code>', page
    )

"""Concurrent writers on PostgreSQL: the compare-and-set and the reference integrity hold under races."""

import pytest
from django.db import connection
from rest_framework.test import APIClient

from controlplane.auth.actor import CLI_ACTOR
from controlplane.auth.services import operator_token_mint
from policy.models import RuleService, Service
from tests.support.helpers import race
from tests.support.requirements import require

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_api(transactional_db):
    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    secret = operator_token_mint(actor=CLI_ACTOR, data={"name": "race"}).secret
    return lambda: _client(secret)


def _client(secret):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def test_two_writers_with_the_same_version_exactly_one_wins(pg_api):
    api = pg_api()
    for attempt in range(10):
        service = api.post(
            "/api/v1/services",
            {"name": f"svc{attempt}", "entries": [{"protocol": "tcp", "port": 1}]},
            format="json",
        ).json()
        path = f"/api/v1/services/{service['id']}"

        def writer(port):
            return lambda: pg_api().put(
                path,
                {"name": f"svc{attempt}", "entries": [{"protocol": "tcp", "port": port}]},
                format="json",
                HTTP_IF_MATCH=f'"{service["version"]}"',
            )

        statuses = sorted(r.status_code for r in race(writer(2), writer(3)))
        assert statuses == [200, 412]


def test_two_rule_writers_with_the_same_version_exactly_one_wins(pg_api):
    api = pg_api()
    ruleset = api.post(
        "/api/v1/rulesets",
        {
            "name": "r",
            "scope": "",
            "rules": [{"sources": [{"any": True}], "services": [{"protocol": "icmp"}]}],
        },
        format="json",
    ).json()
    rule = ruleset["rules"][0]
    path = f"/api/v1/rulesets/{ruleset['id']}/rules/{rule['id']}"

    def writer(description):
        return lambda: pg_api().put(
            path, {**rule, "description": description}, format="json", HTTP_IF_MATCH=f'"{rule["version"]}"'
        )

    statuses = sorted(r.status_code for r in race(writer("a"), writer("b"), writer("c")))
    assert statuses == [200, 412, 412]


def test_delete_while_referenced_never_leaves_a_dangling_reference(pg_api):
    api = pg_api()
    outcomes = set()
    for attempt in range(15):
        service = api.post(
            "/api/v1/services",
            {"name": f"s{attempt}", "entries": [{"protocol": "udp", "port": 53}]},
            format="json",
        ).json()
        ruleset = api.post(
            "/api/v1/rulesets", {"name": f"rs{attempt}", "scope": "", "rules": []}, format="json"
        ).json()

        def delete():
            return pg_api().delete(
                f"/api/v1/services/{service['id']}", HTTP_IF_MATCH=f'"{service["version"]}"'
            )

        def reference():
            return pg_api().post(
                f"/api/v1/rulesets/{ruleset['id']}/rules",
                {"sources": [{"any": True}], "services": [{"service": service["id"]}]},
                format="json",
            )

        deleted, referenced = race(delete, reference)
        outcome = (deleted.status_code, referenced.status_code)
        assert outcome in {(204, 422), (409, 201)}, outcome
        if referenced.status_code == 422:
            assert referenced.json()["errors"][0]["rule"] == "unknown-reference"
        outcomes.add(outcome)
    live = Service.objects.values("id")
    assert not RuleService.objects.filter(service__isnull=False).exclude(service__in=live).exists()

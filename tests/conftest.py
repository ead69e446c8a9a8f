import os
import re

import pytest
from rest_framework.test import APIClient

from controlplane.auth.actor import CLI_ACTOR

PASSWORD = "correct horse battery staple"


def _redis_of_this_worker(url: str, worker: str) -> str:
    """Under pytest-xdist (.ci/run's `-n 2`) each worker gets a Redis database of its own, the next
    after REDIS_TEST_URL's for worker gw1: serve processes of two tests running at once on the same
    database would share its fleet-wide keys (the stream authentications' bound, the channel layer's
    groups)."""
    number = int(worker.removeprefix("gw"))
    found = re.fullmatch(r"(redis://[^/]+)(?:/(\d+))?", url)
    if found is None or number == 0:
        return url
    return f"{found[1]}/{int(found[2] or 0) + number}"


if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("REDIS_TEST_URL"):
    os.environ["REDIS_TEST_URL"] = _redis_of_this_worker(
        os.environ["REDIS_TEST_URL"], os.environ["PYTEST_XDIST_WORKER"]
    )


@pytest.fixture(scope="session")
def django_db_modify_db_settings_xdist_suffix(request):
    """pytest-django's own, which takes our SQLite engine (controlplane.sqlite) for a server's and
    names a file for it: each xdist worker gets a PostgreSQL test database of its own (suffixed with
    the worker's id), and on SQLite keeps Django's test database in memory, its process's own."""
    worker = getattr(request.config, "workerinput", {}).get("workerid")
    if not worker:
        return
    from django.conf import settings

    for database in settings.DATABASES.values():
        if database["ENGINE"] != "controlplane.sqlite":
            test = database.setdefault("TEST", {})
            test["NAME"] = f"{test.get('NAME') or 'test_' + str(database['NAME'])}_{worker}"


@pytest.fixture
def anon(db):
    return APIClient()


@pytest.fixture
def operator_password(db):
    from controlplane.auth.services import operator_set_password

    operator_set_password(actor=CLI_ACTOR, password=PASSWORD)
    return PASSWORD


@pytest.fixture
def token(db):
    from controlplane.auth.services import operator_token_mint

    return operator_token_mint(actor=CLI_ACTOR, data={"name": "tests"}).secret


@pytest.fixture
def api(token):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


@pytest.fixture
def clock_at(monkeypatch):
    """Move the service's clock forward by a timedelta instead of waiting."""
    from controlplane import clock

    def move(delta):
        monkeypatch.setattr(clock, "_offset", clock._offset + delta)

    return move


@pytest.fixture(autouse=True)
def runtime_facts_reset():
    """serve's runtime facts (listener ports, gateway fingerprint) set by a test stay in that test."""
    from controlplane import runtime

    yield
    runtime.facts_reset()


@pytest.fixture(autouse=True)
def outage_state_reset():
    """The process's record of a database outage (controlplane.outage) made by a test stays in it."""
    from controlplane.outage import outage

    yield
    outage.__init__()  # type: ignore[misc]


UNCHECKED_PATHS = {"/api/v1/schema", "/api/v1/docs"}  # the document itself, and its HTML viewer


@pytest.fixture(autouse=True)
def responses_match_the_published_schema(monkeypatch):
    """Every response an in-process API test receives is checked against docs/openapi.yaml."""
    from django.test.client import Client

    from tests.support.openapi_check import committed_document

    document = committed_document()
    request = Client.request

    def checked_request(self, **environ):
        response = request(self, **environ)
        path = response.request.get("PATH_INFO", "")
        if (
            path.startswith("/api/v1/")
            and path not in UNCHECKED_PATHS
            and not getattr(response, "streaming", False)
        ):
            document.check(
                method=response.request["REQUEST_METHOD"],
                path=path,
                status=response.status_code,
                content_type=response.get("Content-Type", ""),
                body=response.content,
            )
        return response

    monkeypatch.setattr(Client, "request", checked_request)


@pytest.fixture(scope="session", autouse=True)
def gateway_connections_closed(django_db_setup, django_db_blocker):
    """The gateway's pool threads keep their database connections; close them before pytest-django
    drops the test database, which refuses while sessions are open."""
    yield
    from fleet.held_streams import db_pool_close_connections

    with django_db_blocker.unblock():
        db_pool_close_connections()

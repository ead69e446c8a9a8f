import pytest
from rest_framework.test import APIClient

from controlplane.auth.actor import CLI_ACTOR

PASSWORD = "correct horse battery staple"


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

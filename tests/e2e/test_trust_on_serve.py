"""A real `serve`: the login throttle against guesses from many addresses and many at once, the modes of
the data directory's files, and the headers on every answer of both listeners."""

import json
import os
import socket
import stat
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.credential import public_key_encode
from agent.enrol import decode_bundle
from agent.protocol import ENROL_PATH, EnrolRequest
from tests.support.serve_process import ServeProcess, Site, manage, pinned_context

pytestmark = pytest.mark.e2e

PASSWORD = "correct horse battery staple"
FREE_FAILURES = 5  # the defaults serve runs with: per address, and all addresses together
SHARED_FAILURES = 50


@pytest.fixture
def site(tmp_path):
    with Site.fresh(tmp_path / "data", migrated=True) as site:
        yield site


def login_from(serve, address: str, password: str) -> httpx.Response:
    """POST /session from a source address of our choosing: all of 127.0.0.0/8 is this host's."""
    transport = httpx.HTTPTransport(
        verify=pinned_context(serve.served_certificate("operator")), local_address=address
    )
    with httpx.Client(base_url=serve.operator_url, transport=transport, timeout=60) as http:
        return http.post("/api/v1/session", json={"password": password})


def test_guesses_at_once_and_from_many_addresses_get_exactly_the_budgets(site):
    site.set_operator_password(PASSWORD)
    serve = site.serve()
    with ThreadPoolExecutor(40) as pool:
        at_once = list(pool.map(lambda _: login_from(serve, "127.0.0.1", "guess guess"), range(40)))
    statuses = [r.status_code for r in at_once]
    assert statuses.count(401) == FREE_FAILURES, statuses
    assert statuses.count(429) == 40 - FREE_FAILURES, statuses
    assert all(int(r.headers["Retry-After"]) > 0 for r in at_once if r.status_code == 429)

    # 40 more addresses, 5 guesses each: only what is left of the shared budget is tried.
    spread = [
        login_from(serve, f"127.0.0.{10 + address}", "guess guess").status_code
        for address in range(40)
        for _ in range(FREE_FAILURES)
    ]
    assert spread.count(401) == SHARED_FAILURES - FREE_FAILURES, spread
    assert spread.count(429) == 40 * FREE_FAILURES - (SHARED_FAILURES - FREE_FAILURES), spread
    locked_out = login_from(serve, "127.0.0.200", PASSWORD)
    assert locked_out.status_code == 429 and int(locked_out.headers["Retry-After"]) > 0
    serve.wait_for_stderr(r"every login is refused until .* operator-login-throttle reset")

    # The host's way back in: the operator logs in at once, from any address.
    reset = serve.manage("operator-login-throttle", "reset", "--json")
    assert json.loads(reset.stdout) == {"addresses": 1 + (SHARED_FAILURES - FREE_FAILURES) // FREE_FAILURES}
    assert login_from(serve, "127.0.0.1", PASSWORD).status_code == 200
    assert login_from(serve, "127.0.0.200", PASSWORD).status_code == 200


# --- the data directory -------------------------------------------------------------------------------


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def sqlite_serve(data_dir) -> ServeProcess:
    """SQLite in the data directory, whatever DATABASE_URL says: its files are what is checked."""
    return ServeProcess(data_dir, database_url=None)


def test_a_fresh_data_directory_is_private(tmp_path):
    data_dir = tmp_path / "fresh"
    manage(data_dir, "operator-password", "--stdin", input=PASSWORD + "\n")  # the first command creates it
    with sqlite_serve(data_dir) as serve, serve.client() as http:
        assert http.post("/api/v1/session", json={"password": PASSWORD}).status_code == 200  # a write
        assert (data_dir / "palisade.sqlite3-wal").exists()
        assert mode(data_dir) == 0o700
        files = {path.name: mode(path) for path in data_dir.iterdir()}
        assert {"palisade.sqlite3", "palisade.sqlite3-wal", "palisade.sqlite3-shm", "secret-key"} <= set(
            files
        )
        assert {"operator-key.pem", "gateway-key.pem"} <= set(files)
        assert {name: m for name, m in files.items() if m & 0o077} == {}
        assert "open to other users" not in serve.stderr_text()


def test_an_existing_lax_data_directory_is_warned_about_and_its_database_made_private(tmp_path):
    data_dir = tmp_path / "lax"
    manage(data_dir, "operator-password", "--stdin", input=PASSWORD + "\n")
    data_dir.chmod(0o755)  # as an earlier version, or the operator, left it
    (data_dir / "palisade.sqlite3").chmod(0o644)
    with sqlite_serve(data_dir) as serve, serve.client() as http:
        serve.wait_for_stderr(
            rf"the data directory {data_dir} is open to other users \(mode 0755\).*chmod 700"
        )
        serve.wait_for_stderr(r"palisade\.sqlite3 was open to other users \(mode 0644\); made it 0600")
        assert http.post("/api/v1/session", json={"password": PASSWORD}).status_code == 200
        assert mode(data_dir) == 0o755  # the operator's directory: warned about, not changed
        for name in ("palisade.sqlite3", "palisade.sqlite3-wal", "palisade.sqlite3-shm", "operator-key.pem"):
            assert mode(data_dir / name) == 0o600, name


# --- headers ------------------------------------------------------------------------------------------

HSTS = "max-age=31536000"


def raw_answer(serve, listener: str, request: bytes) -> bytes:
    with socket.create_connection(serve.address(listener), timeout=10) as raw:
        with pinned_context(serve.served_certificate(listener)).wrap_socket(raw) as tls:
            tls.sendall(request)
            answer = b""
            while chunk := tls.recv(65536):
                answer += chunk
    return answer


def test_every_answer_of_both_listeners_carries_hsts_and_secrets_are_never_stored(site):
    site.set_operator_password(PASSWORD)
    serve = site.serve()
    bearer = {"Authorization": f"Bearer {site.mint_operator_token()}"}
    with (
        serve.client("operator") as http,
        httpx.Client(
            base_url=serve.gateway_url, verify=pinned_context(serve.served_certificate("gateway")), timeout=30
        ) as gateway,
    ):
        secret_bearing = {
            "login": http.post("/api/v1/session", json={"password": PASSWORD}),
            "operator token": http.post("/api/v1/operator-tokens", json={"name": "ci"}, headers=bearer),
            "provisioning token": http.post(
                "/api/v1/provisioning-tokens", json={"description": "e2e"}, headers=bearer
            ),
        }
        bundle = decode_bundle(secret_bearing["provisioning token"].json()["bundle"])
        enrol = EnrolRequest(
            token=bundle["token"],
            public_key=public_key_encode(Ed25519PrivateKey.generate().public_key()),
            hostname="web-1",
            addresses=["192.0.2.10"],
            agent_version="0.1.0",
        )
        secret_bearing["enrolment"] = gateway.post(ENROL_PATH, json=enrol.to_dict())
        assert [r.status_code for r in secret_bearing.values()] == [200, 201, 201, 201]
        others = {
            "me": http.get("/api/v1/me", headers=bearer),
            "unauthenticated": http.get("/api/v1/me"),
            "not found": http.get("/api/v1/nothing-here", headers=bearer),
            "too large": http.post("/api/v1/services", content=b"x" * (2 << 20), headers=bearer),
            "console": http.get("/login"),
            "static": http.get("/static/console/console.js"),
            "gateway info": gateway.get("/agent/v1/info"),
            "gateway not found": gateway.get("/api/v1/me"),
            "gateway refusal": gateway.post(ENROL_PATH, json={"v": 1, "token": "pal_pt_wrong"}),
        }
    for name, response in {**secret_bearing, **others}.items():
        assert response.headers.get("Strict-Transport-Security") == HSTS, name
    for name, response in secret_bearing.items():
        assert response.headers.get("Cache-Control") == "no-store", name
    for name in ("me", "unauthenticated", "console", "gateway info"):
        assert others[name].headers.get("Cache-Control") == "no-store", name
    # Answers Twisted's HTTP layer makes before any application code runs.
    for listener in ("operator", "gateway"):
        answer = raw_answer(serve, listener, b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
        assert (
            answer.startswith(b"HTTP/1.1 400 ")
            and f"Strict-Transport-Security: {HSTS}\r\n".encode() in answer
        )

"""`manage.py serve` as a real process: TLS on both listeners, certificates, routing, start and stop."""

import datetime
import json
import re
import signal
import socket
import ssl
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from controlplane.tls import ensure_certificate, fingerprint_of
from tests.support.requirements import require
from tests.support.serve_process import Site, free_port, manage, throwaway_database

pytestmark = pytest.mark.e2e

PASSWORD = "correct horse battery staple"
PROBLEM = "application/problem+json"


@pytest.fixture
def site(tmp_path):
    """Storage with the schema applied: what these tests look at comes after serve's migrations."""
    with Site.fresh(tmp_path / "data", migrated=True) as site:
        yield site


@pytest.fixture
def empty_site(tmp_path):
    """Empty storage: serve applies every migration at its first start."""
    with Site.fresh(tmp_path / "data") as site:
        yield site


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def assert_one_line_error(process, *fragments: str) -> None:
    text = process.stderr_text()
    assert "Traceback" not in text, text
    errors = error_lines(text)
    assert len(errors) == 1, text
    for fragment in fragments:
        assert fragment in errors[0], text


def test_first_start_generates_certificates_and_logs_the_fingerprints_it_serves(empty_site):
    site = empty_site
    serve = site.serve()
    for listener in ("operator", "gateway"):
        cert = site.data_dir / f"{listener}-cert.pem"
        key = site.data_dir / f"{listener}-key.pem"
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        served = getattr(serve, f"{listener}_fingerprint_served")()
        assert served == fingerprint_of(cert.read_bytes())
        assert serve.logged_fingerprint(listener) == served
    log = serve.stderr_text()
    assert re.search(
        r"operator listener https://\S+:\d+/ certificate SHA-256 fingerprint ([0-9A-F]{2}:){31}", log
    )
    assert f"console https://127.0.0.1:{serve.address('operator')[1]}/" in log
    assert f"manage.py operator-password --data-dir {site.data_dir}" in log
    assert re.search(r"applying \d+ database migrations", log), log
    assert serve.stop() == 0


def test_a_later_start_reuses_the_certificates(site):
    first = site.serve()
    fingerprints = (first.operator_fingerprint_served(), first.gateway_fingerprint_served())
    assert first.stop() == 0
    second = site.serve(["--operator-san", "console.example.org"])
    assert (second.operator_fingerprint_served(), second.gateway_fingerprint_served()) == fingerprints
    assert second.logged_fingerprint("operator") == fingerprints[0]
    # The stored certificate lacks the new name: kept, with a warning that names it.
    assert re.search(
        r"WARNING .*operator certificate .* lacks the names console\.example\.org", second.stderr_text()
    )
    assert second.stop() == 0


def test_each_listener_serves_only_its_own_paths(site):
    serve = site.serve()
    with serve.client("operator") as operator, serve.client("gateway") as gateway:
        me = operator.get("/api/v1/me")
        assert me.status_code == 401
        assert me.headers["content-type"] == PROBLEM
        assert me.json()["type"] == "urn:service:problem:unauthenticated"

        info = gateway.get("/agent/v1/info")
        assert info.status_code == 200
        assert info.json()["service"] == "palisade-gateway"

        for client, path in ((gateway, "/api/v1/me"), (operator, "/agent/v1/info")):
            response = client.get(path)
            assert response.status_code == 404
            assert response.headers["content-type"] == PROBLEM
            assert response.json()["type"] == "urn:service:problem:not-found"


@pytest.mark.parametrize("listener", ["operator", "gateway"])
def test_plaintext_http_gets_no_http_answer(site, listener):
    serve = site.serve()
    with socket.create_connection(serve.address(listener), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    assert not answer.startswith(b"HTTP/")


def test_an_operator_token_reaches_me_with_the_site_label_and_gateway_address(site):
    serve = site.serve(["--site-label", "lab west", "--gateway-advertise", "gw.example.org:9443"])
    token = serve.mint_operator_token()
    with serve.client() as http:
        me = http.get("/api/v1/me", headers={"Authorization": f"Bearer {token}"})
    assert me.status_code == 200
    assert me.json()["credential"]["kind"] == "token"
    assert me.json()["site_label"] == "lab west"
    assert me.json()["gateway_address"] == "gw.example.org:9443"
    assert me.json()["gateway_addresses"] == ["gw.example.org:9443"]


def test_several_advertised_gateways_are_given_to_agents_in_order(site):
    listed = ["gw-b.example.org:9443", "[2001:db8::1]:8443", "gw-a.example.org:8443"]
    serve = site.serve([arg for address in listed for arg in ("--gateway-advertise", address)])
    token = serve.mint_operator_token()
    with serve.client(headers={"Authorization": f"Bearer {token}"}) as http:
        assert http.get("/api/v1/me").json()["gateway_addresses"] == listed
        minted = http.post("/api/v1/provisioning-tokens", json={"description": "two"})
    from agent.bundle import bundle_decode

    assert bundle_decode(minted.json()["bundle"])["gateways"] == listed
    # A host command beside serve mints the same bundle: it reads the list serve recorded.
    out = site.manage("provisioning-token", "mint", "--description", "cli", "--json").stdout
    assert bundle_decode(json.loads(out)["bundle"])["gateways"] == listed
    assert serve.stop() == 0


def test_a_serve_process_presenting_another_gateway_certificate_than_the_others_is_warned(site, tmp_path):
    first = site.serve()
    shared = first.gateway_fingerprint_served()
    assert first.stop() == 0
    # The certificate and key files named, as another host would: the same fingerprint, no warning.
    second = site.serve(
        ["--gateway-tls-cert", str(site.data_dir / "gateway-cert.pem"),
         "--gateway-tls-key", str(site.data_dir / "gateway-key.pem")],
    )  # fmt: skip
    assert second.gateway_fingerprint_served() == shared
    assert second.stop() == 0
    assert "is not the one this process presents" not in second.stderr_text()
    (tmp_path / "elsewhere").mkdir()
    own = ensure_certificate(tmp_path / "elsewhere", "gateway", [])
    other = site.serve(["--gateway-tls-cert", str(own.cert_path), "--gateway-tls-key", str(own.key_path)])
    other.wait_for_stderr(
        rf"the gateway certificate recorded by the last serve started \(SHA-256 {shared}\) "
        rf"is not the one this process presents \({own.fingerprint}\)"
    )
    assert other.stop() == 0


def test_an_advertised_gateway_named_twice_is_refused(site):
    done = site.manage("serve", "--gateway-advertise", "gw:1", "--gateway-advertise", "gw:1", check=False)
    assert done.returncode != 0 and "names the same address twice" in done.stderr


def test_the_gateway_address_is_derived_from_the_gateway_listener(site):
    serve = site.serve()
    token = serve.mint_operator_token()
    with serve.client() as http:
        me = http.get("/api/v1/me", headers={"Authorization": f"Bearer {token}"}).json()
    assert me["gateway_address"] == f"127.0.0.1:{serve.address('gateway')[1]}"


def test_the_flows_command_beside_serve_states_serve_s_retention(site):
    """serve prunes by its `--flow-retention-days`; `manage.py flows`, run beside it with another
    environment, states the same `retained_from` as the API."""
    serve = site.serve(["--flow-retention-days", "3"])
    now = datetime.datetime.now(datetime.UTC)
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    four_days = ("--from", text(now - datetime.timedelta(days=4)), "--to", text(now))
    out = serve.manage("flows", "rollup", "--group-by", "peer", *four_days, "--json").stdout
    covered = json.loads(out)["coverage"]
    assert covered["begins_before_retention"] is True and covered["complete"] is False
    retained_from = datetime.datetime.fromisoformat(covered["retained_from"])
    assert abs(retained_from - (now - datetime.timedelta(days=3, hours=1))) < datetime.timedelta(minutes=1)


def test_a_session_survives_a_restart(site):
    first = site.serve()
    first.set_operator_password(PASSWORD)
    with first.client() as http:
        login = http.post("/api/v1/session", json={"password": PASSWORD})
        assert login.status_code == 200
        cookie = login.cookies["palisade_session"]
    assert first.stop() == 0

    second = site.serve()
    with second.client() as http:
        me = http.get("/api/v1/me", headers={"Cookie": f"palisade_session={cookie}"})
    assert me.status_code == 200
    assert me.json()["credential"]["kind"] == "session"
    assert second.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_it_cleanly(site, sig):
    serve = site.serve()
    assert serve.stop(sig) == 0
    assert "Traceback" not in serve.stderr_text()
    assert "palisade.serve stopped" in serve.stderr_text()


def test_stopping_right_after_websocket_upgrades_logs_no_traceback(site):
    """daphne's shutdown read the application instance of connections that had none yet (a websocket
    upgraded a moment before), and its KeyError aborted the step that cancels open streams."""
    from websockets.sync.client import connect

    from agent.protocol import STREAM_PATH
    from tests.support.serve_process import pinned_context

    serve = site.serve()
    host, port = serve.address("gateway")
    context = pinned_context(serve.served_certificate("gateway"))
    sockets = []
    for _ in range(8):
        try:
            sockets.append(connect(f"wss://{host}:{port}{STREAM_PATH}", ssl=context, open_timeout=3))
        except TimeoutError:
            # A rare upgrade goes unanswered for 60 s while other streams are open (seen before this fix too);
            # this test needs upgrades just before the stop, not every one of them.
            continue
    assert sockets
    try:
        assert serve.stop(signal.SIGTERM) == 0
    finally:
        for ws in sockets:
            ws.close_socket()
    log = serve.stderr_text()
    assert "Traceback" not in log and "CRITICAL" not in log, log
    assert "palisade.serve stopped" in log


def _raw_request(serve, request: bytes, timeout: float = 10) -> bytes:
    from tests.support.serve_process import pinned_context

    host, port = serve.address("operator")
    with socket.create_connection((host, port), timeout=timeout) as raw:
        with pinned_context(serve.served_certificate("operator")).wrap_socket(raw) as tls_socket:
            tls_socket.sendall(request)
            answer = b""
            while chunk := tls_socket.recv(65536):
                answer += chunk
    return answer


@pytest.mark.parametrize(
    "request_bytes, status, name",
    [
        (b"GET /api/v1/me?" + b"q" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431, "header-too-large"),
        (
            b"GET /api/v1/me HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
            431,
            "header-too-large",
        ),
        (
            b"GET /api/v1/me HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(17))
            + b"\r\n",
            431,
            "header-too-large",
        ),
        (b"GET /api/v1/me HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400, "malformed-request"),
    ],
    ids=["long-request-line", "long-header", "headers-over-16k", "malformed-header"],
)
def test_requests_refused_by_the_http_layer_get_a_problem_at_once(site, request_bytes, status, name):
    serve = site.serve()
    answer = _raw_request(serve, request_bytes)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert b"Content-Type: application/problem+json" in head
    assert json.loads(body)["type"] == f"urn:service:problem:{name}"


def test_a_port_in_use_is_a_one_line_error(site):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        serve = site.process(operator_listen=f"127.0.0.1:{port}").start(wait=False)
        assert serve.wait() != 0
    assert_one_line_error(serve, f"127.0.0.1:{port}", "--operator-listen", "in use")


@pytest.mark.parametrize("given", ["--operator-tls-cert", "--operator-tls-key", "--gateway-tls-key"])
def test_a_certificate_without_its_key_is_a_one_line_error(site, tmp_path, given):
    pem = ensure_certificate(tmp_path, "given", [])
    path = pem.cert_path if given.endswith("cert") else pem.key_path
    serve = site.process([given, str(path)]).start(wait=False)
    assert serve.wait() != 0
    listener = given.split("-")[2]
    assert_one_line_error(serve, f"--{listener}-tls-cert and --{listener}-tls-key go together")


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--operator-listen", "8080"], "--operator-listen '8080'"),
        (["--gateway-listen", "[::1:8443"], "--gateway-listen"),
        (["--gateway-listen", ":70000"], "port from 1 to 65535"),
        (["--operator-listen", ":9999", "--gateway-listen", "127.0.0.1:9999"], "both use port 9999"),
    ],
    ids=["no-colon", "unclosed-bracket", "port-range", "same-port"],
)
def test_a_bad_listen_address_is_a_one_line_error(site, flags, fragment):
    serve = site.process(flags).start(wait=False)
    assert serve.wait() != 0
    assert_one_line_error(serve, fragment)


def test_an_operator_given_certificate_is_served(site, tmp_path):
    (tmp_path / "pki").mkdir()
    given = ensure_certificate(tmp_path / "pki", "console", ["console.example.org"])
    serve = site.serve(
        ["--operator-tls-cert", str(given.cert_path), "--operator-tls-key", str(given.key_path)]
    )
    assert serve.operator_fingerprint_served() == given.fingerprint
    assert serve.logged_fingerprint("operator") == given.fingerprint
    assert not (site.data_dir / "operator-cert.pem").exists()
    assert (site.data_dir / "gateway-cert.pem").exists()


def test_each_request_is_logged_with_method_path_status_and_duration(site):
    serve = site.serve()
    with serve.client() as http:
        http.get("/api/v1/me?probe=1")
    serve.wait_for_stderr(r"palisade\.access GET /api/v1/me\?probe=1 401 \d+(\.\d+)?ms operator ")


def _has_ipv6_loopback() -> bool:
    try:
        free_port("::1")
    except OSError:
        return False
    return True


def test_an_ipv6_loopback_listener_works(site):
    require(_has_ipv6_loopback(), "this host has no IPv6 loopback (::1)")
    serve = site.serve(operator_listen=f"[::1]:{free_port('::1')}")
    assert serve.operator_url.startswith("https://[::1]:")
    with serve.client() as http:
        assert http.get("/api/v1/me").status_code == 401
    assert serve.logged_fingerprint("operator") == serve.operator_fingerprint_served()
    assert serve.stop() == 0


def test_two_processes_starting_together_on_one_site_both_serve(empty_site):
    """Migrations and certificate generation are serialised between processes sharing storage."""
    first, second = empty_site.process(), empty_site.process()
    first.start(wait=False)
    second.start(wait=False)
    first.wait_ready()
    second.wait_ready()
    assert first.operator_fingerprint_served() == second.operator_fingerprint_served()
    assert first.stop() == 0
    assert second.stop() == 0


def _issue(subject: str, issuer_key, issuer_name, *, ca: bool, sans=()):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(n) for n in sans]), critical=False
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def test_a_given_full_chain_file_serves_its_intermediates(site, tmp_path):
    root_key, root = _issue("Test root", None, None, ca=True)
    mid_key, mid = _issue("Test intermediate", root_key, root.subject, ca=True)
    leaf_key, leaf = _issue("console", mid_key, mid.subject, ca=False, sans=["localhost"])
    pem = serialization.Encoding.PEM
    (tmp_path / "fullchain.pem").write_bytes(leaf.public_bytes(pem) + mid.public_bytes(pem))
    (tmp_path / "key.pem").write_bytes(
        leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    serve = site.serve(
        [
            "--operator-tls-cert",
            str(tmp_path / "fullchain.pem"),
            "--operator-tls-key",
            str(tmp_path / "key.pem"),
        ]
    )
    # Trusting only the root, the handshake succeeds only if the intermediate is sent too.
    context = ssl.create_default_context(cadata=root.public_bytes(pem).decode())
    with socket.create_connection(serve.address("operator"), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            assert tls.getpeercert(binary_form=True) == leaf.public_bytes(serialization.Encoding.DER)
    assert serve.logged_fingerprint("operator") == fingerprint_of(leaf.public_bytes(pem))


def test_host_commands_work_on_a_fresh_data_directory_before_the_first_serve(tmp_path):
    """operator-password may be the very first command a new user runs."""
    with throwaway_database() as database_url:
        done = manage(
            tmp_path / "fresh",
            "operator-password",
            "--stdin",
            input="a long enough password\n",
            database_url=database_url,
        )
        assert "Operator password set" in done.stdout
        listed = manage(tmp_path / "fresh", "operator-token", "list", "--json", database_url=database_url)
        assert json.loads(listed.stdout) == {"items": []}

"""Request bodies on the real serve: a flow report's sender is checked before its body is received, and
the bodies serve holds at once are bounded (controlplane/body_gate.py), while serve's memory is watched.

Uploads here send their head and a first piece of the body, then wait for the answer: the refusals
must come without the rest of the body (on a serve that read bodies first, nothing came back)."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.credential import credential_parse, credential_payload, credential_sign, public_key_encode
from agent.enrol import enrol
from agent.flowreport import report_body
from agent.flowreporter import FlowReporter, FlowSettings
from agent.flowwindow import FlowKey, Windows
from agent.protocol import FLOWS_PATH
from agent.state import StateDir
from agent.tls import pinned_context as agent_pinned_context
from tests.support.serve_process import Site, pinned_context
from tests.support.uploads import Upload, chunk, flow_report_head

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024
CLAIMED = 32 * MiB  # the largest flow report there is
UPLOADS = 200
FIRST_PIECE = 64 * 1024
RSS_BOUND = 150 * MiB  # above serve's idle resident size
BUDGET = 64 * MiB  # serve's default for the gateway listener
LARGE_ROOM = 48 * MiB  # what bodies over 1 MiB may take of it: a quarter is kept for smaller ones


def _memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def _headers(workload: str, credential: str, *, length: int | None = CLAIMED, expect: bool = False) -> dict:
    return flow_report_head(workload, credential, length=length, expect=expect)


_chunk = chunk


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("bodies")
    with Site.fresh(root / "data", migrated=True) as site:
        serve = site.serve()
        serve.gateway_context = pinned_context(serve.served_certificate("gateway"))
        serve.operator_context = pinned_context(serve.served_certificate("operator"))
        serve.operator_token = serve.mint_operator_token()
        operator = serve.client("operator", headers={"Authorization": f"Bearer {serve.operator_token}"})
        bundle = operator.post(
            "/api/v1/provisioning-tokens", json={"description": "bodies", "max_uses": 3}
        ).json()
        operator.close()
        for n, name in enumerate(("web", "db", "cache")):  # a workload has one body in flight at a time
            enrol(bundle["bundle"], str(root / name), hostname=name, addresses=[f"10.50.0.{n + 1}"])
        agent = StateDir(root / "web").load_enrolment()
        yield serve, agent, root
        assert serve.stop() == 0
        assert "Traceback" not in serve.stderr_text()


def _stale_credentials(agent, data_dir: Path) -> list[str]:
    """Credentials signed with serve's own key that name the workload, but are not its current one: a
    serial it does not have, and another key. (Expiry is the workload's, recorded when the credential is
    issued: tests/flows/test_ingestion.py moves the clock past it.)"""
    key = serialization.load_pem_private_key((data_dir / "agent-signing-key.pem").read_bytes(), password=None)
    current = credential_parse(agent.credential)
    now = datetime.now(UTC)

    def signed(**changes):
        fields = {
            "workload_id": current["workload_id"],
            "public_key": current["public_key"],
            "serial": current["serial"],
            "issued_at": now - timedelta(days=2),
            "expires_at": now + timedelta(days=2),
            **changes,
        }
        return credential_sign(credential_payload(**fields), key)

    other_key = public_key_encode(Ed25519PrivateKey.generate().public_key())
    return [signed(serial=current["serial"] + 1), signed(public_key=other_key)]


def _unauthenticated_kinds(agent, data_dir: Path) -> list[dict[str, str]]:
    workload = agent.identity.workload_id
    other_serial, other_key = _stale_credentials(agent, data_dir)
    return [
        _headers(workload, "not a credential"),  # malformed
        _headers(str(uuid.uuid4()), agent.credential),  # unknown workload
        _headers("not-a-uuid", agent.credential),
        _headers(workload, other_serial),  # valid-looking, not its current serial
        _headers(workload, other_key),  # valid-looking, not its key
        _headers(workload, agent.credential[:-8] + "AAAAAAA="),  # ours in shape, signature altered
        {k: v for k, v in _headers(workload, agent.credential).items() if k != "Palisade-Signature"},
        _headers(workload, "not a credential", length=None),  # chunked: no Content-Length
    ]


def test_unauthenticated_uploads_are_refused_before_their_bodies_and_memory_stays_bounded(lab):
    serve, agent, root = lab
    pid = serve.process.pid
    idle = _memory(pid)["VmRSS"]
    kinds = _unauthenticated_kinds(agent, root / "data")
    first_piece = b"x" * FIRST_PIECE

    def upload(n: int):
        headers = kinds[n % len(kinds)]
        up = Upload(serve, headers)
        try:
            up.send(_chunk(first_piece) if "Transfer-Encoding" in headers else first_piece)
            return up.answer()
        finally:
            up.close()

    with ThreadPoolExecutor(UPLOADS) as pool:
        answers = list(pool.map(upload, range(UPLOADS)))

    statuses = [status for status, _, _ in answers]
    assert statuses == [401] * UPLOADS, f"statuses other than 401: {sorted(set(statuses))} (0: no answer)"
    for _, headers, body in answers:
        assert headers["connection"] == "close"
        assert headers["content-type"] == "application/problem+json"
        problem = json.loads(body)
        assert problem["type"] == "urn:service:problem:unauthenticated" and problem["instance"] == FLOWS_PATH
    peak = _memory(pid)["VmHWM"]
    assert peak - idle < RSS_BOUND, f"serve grew from {idle / MiB:.0f} MiB to a peak of {peak / MiB:.0f} MiB"
    serve.wait_for_stderr(r"POST /agent/v1/flows 401 before its body gateway 127\.0\.0\.1$")  # the access log


def _other(root: Path, name: str):
    """Another enrolled workload of the lab: "db" or "cache"."""
    return StateDir(root / name).load_enrolment()


def test_authenticated_uploads_beyond_the_budget_wait_with_503_and_memory_stays_bounded(lab):
    serve, agent, root = lab
    pid = serve.process.pid
    idle = _memory(pid)["VmRSS"]
    db, cache = _other(root, "db"), _other(root, "cache")
    size = LARGE_ROOM // 2  # two fill the room bodies over 1 MiB may take, a third does not

    holders = [
        Upload(serve, _headers(a.identity.workload_id, a.credential, length=size, expect=True))
        for a in (agent, db)
    ]
    try:
        assert [h.answer()[0] for h in holders] == [100, 100]  # admitted: send the body

        def refused(_):
            up = Upload(serve, _headers(cache.identity.workload_id, cache.credential, length=size))
            try:
                up.send(b"x" * FIRST_PIECE)
                return up.answer()
            finally:
                up.close()

        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(refused, range(20)))
        assert [status for status, _, _ in answers] == [503] * 20
        for _, headers, body in answers:
            assert headers["retry-after"] == "1" and headers["connection"] == "close"
            problem = json.loads(body)
            assert (
                problem["type"] == "urn:service:problem:service-unavailable" and problem["retry_after"] == 1
            )

        # The admitted bodies arrive whole, and are answered on their merits (not signed: 401).
        piece = b"x" * MiB
        for holder in holders:
            for _ in range(size // MiB):
                assert holder.send(piece)
        assert [h.answer()[0] for h in holders] == [401, 401]
    finally:
        for holder in holders:
            holder.close()

    # Answered, they gave their bytes back: a new body fits again.
    again = Upload(serve, _headers(cache.identity.workload_id, cache.credential, length=size, expect=True))
    try:
        assert again.answer()[0] == 100
    finally:
        again.close()
    peak = _memory(pid)["VmHWM"]
    # Two 24 MiB bodies at once, each held about twice (the HTTP entry's copy and Django's read).
    assert peak - idle < RSS_BOUND + 2 * size, f"serve grew from {idle / MiB:.0f} to {peak / MiB:.0f} MiB"


def test_a_body_that_claims_more_than_it_sends_gives_its_bytes_back_when_its_connection_ends(lab):
    serve, agent, root = lab
    senders = (agent, _other(root, "db"))
    for _ in range(3):  # two fill the room: a claim left behind would refuse the next round
        uploads = [_admitted(serve, sender, LARGE_ROOM // 2) for sender in senders]
        for up in uploads:
            up.send(b"x" * 1024)
            up.close()


def _admitted(serve, agent, size: int) -> Upload:
    """An upload serve has admitted (100 Continue), once the bytes (and the one body in flight of the
    workload) of those before it are given back."""
    deadline = time.monotonic() + 10
    while True:
        up = Upload(serve, _headers(agent.identity.workload_id, agent.credential, length=size, expect=True))
        status = up.answer()[0]
        if status == 100:
            return up
        up.close()
        assert status in (429, 503) and time.monotonic() < deadline, status
        time.sleep(0.05)


def test_bodies_over_the_limit_are_refused_as_they_are_announced_or_as_they_stream(lab):
    serve, agent, _ = lab
    workload, credential = agent.identity.workload_id, agent.credential
    announced = Upload(serve, _headers(workload, credential, length=CLAIMED + 1))
    assert announced.answer()[0] == 413
    announced.close()

    chunked = Upload(serve, _headers(workload, credential, length=None))
    piece = _chunk(b"x" * MiB)
    sent = 0
    while sent <= CLAIMED and chunked.send(piece):
        sent += MiB
    status, _, body = chunked.answer()
    chunked.close()
    assert status == 413 and json.loads(body)["max_bytes"] == CLAIMED


def test_the_agent_keeps_its_windows_while_refused_and_waits_as_long_as_a_503_asks(lab):
    serve, agent, root = lab
    state = StateDir(root / "web")
    reporter = FlowReporter(
        state,
        settings=FlowSettings(),
        context=lambda: agent_pinned_context(agent.identity.certificate_pem),
        policy_version=lambda: "v1",
        table_absent=lambda: False,
        process_start_id="p1",
        log=lambda *args, **fields: None,
        sources={},
        accounting=False,
    )
    windows = Windows(length=60, max_keys=100_000, accounting=False)
    now = time.time()
    for i in range(30_000):  # about 7 MB: the answer comes while the agent is still sending
        windows.connection_opened(
            FlowKey(f"10.70.{i // 256}.{i % 256}", "tcp", 443, "observed", None), now - 120
        )
    reporter.buffer.add(*windows.close_due(now, "v1"))
    waiting = reporter.buffer.pending()

    # The room of bodies over 1 MiB is full, and the report is about 7 MB.
    holders = [_admitted(serve, _other(root, name), LARGE_ROOM // 2) for name in ("db", "cache")]
    try:
        assert reporter.send_pending() is False
        assert reporter.retry_after == 1
    finally:
        for holder in holders:
            holder.close()
    assert reporter.buffer.pending() == waiting

    reporter.state = _Altered(state)  # its credential damaged: refused from the headers
    assert reporter.send_pending() is False and reporter.retry_after is None
    assert reporter.buffer.pending() == waiting

    reporter.state = state
    assert reporter.send_pending() is True
    assert reporter.buffer.pending() == ([], [])


class _Altered:
    """The agent's state directory, with its credential's signature altered."""

    def __init__(self, state: StateDir):
        self.state = state

    def load_enrolment(self):
        enrolment = self.state.load_enrolment()
        return dataclasses.replace(enrolment, credential=enrolment.credential[:-8] + "AAAAAAA=")

    def __getattr__(self, name):  # everything else as the state directory has it (its gateways)
        return getattr(self.state, name)


def test_a_chunked_report_within_the_limit_is_received_whole_and_stored(lab):
    serve, agent, _ = lab
    body = report_body([], [], now=time.time(), process_start_id="p1", uptime_seconds=1.0, window_seconds=60)
    with serve.client("gateway") as gateway:
        pieces = iter([body[:10], body[10:]])  # no Content-Length: sent chunked
        answer = gateway.post(FLOWS_PATH, content=pieces, headers=agent.flow_report_headers(body))
    assert answer.status_code == 200, answer.text
    assert "Content-Length" not in answer.request.headers


def test_a_refused_client_that_goes_on_sending_is_cut_off(lab):
    """serve reads and discards what follows a refusal, so a client sending blindly reads its answer, but
    only for a moment (body_gate.LINGER_SECONDS): then the connection is aborted."""
    serve, agent, _ = lab
    up = Upload(serve, _headers(str(uuid.uuid4()), agent.credential))
    try:
        assert up.answer()[0] == 401
        deadline = time.monotonic() + 15
        while up.send(b"x" * FIRST_PIECE):
            assert time.monotonic() < deadline, "serve still reads a refused body after 15 s"
            time.sleep(0.05)
    finally:
        up.close()


def test_bodies_without_a_credential_cannot_hold_the_operator_listeners_budget(lab):
    """Uploads with no credential (or a bad one) that announce the largest body and send a little of it
    are refused before their bodies, and logins only hold a budget of their own: an operator's write
    answers meanwhile (on a serve that admitted them, the 16 MiB budget was theirs and writes got 503)."""
    serve, _, _ = lab
    largest = 1024 * 1024
    kinds = [{}, {"Authorization": "Bearer pal_op_not-a-token"}, {"Cookie": "palisade_session=pal_s_gone"}]
    held = [
        Upload(serve, {"Content-Type": "application/json", "Content-Length": str(largest), **kinds[n % 3]},
               listener="operator", path="/api/v1/services")
        for n in range(24)
    ] + [
        Upload(serve, {"Content-Type": "application/json", "Content-Length": str(16 * 1024)},
               listener="operator", path="/api/v1/session")
        for _ in range(70)  # more than the logins' own budget holds
    ]  # fmt: skip
    try:
        for up in held:
            up.send(b"{" + b" " * 1000)
        operator = serve.client("operator", headers={"Authorization": f"Bearer {serve.operator_token}"})
        try:
            created = operator.post(
                "/api/v1/services", json={"name": "held-open", "entries": [{"protocol": "tcp", "port": 8443}]}
            )
        finally:
            operator.close()
        assert created.status_code == 201, created.text
        answers = [up.answer() for up in held[:24]]
        assert [status for status, _, _ in answers] == [401] * 24
        assert all(
            json.loads(body)["type"] == "urn:service:problem:unauthenticated" for _, _, body in answers
        )
        too_large = Upload(
            serve, {"Content-Length": str(16 * 1024 + 1)}, listener="operator", path="/api/v1/session"
        )
        try:
            assert too_large.answer()[0] == 413  # a login is a password, not a megabyte
        finally:
            too_large.close()
    finally:
        for up in held:
            up.close()

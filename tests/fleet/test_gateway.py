"""The gateway's stream consumer, in process (the real consumer and channel layer; the e2e tests
drive it over TLS): authentication, the sync events, malformed frames, resend and renewal."""

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent import protocol
from agent.credential import public_key_encode
from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from controlplane.problems import ValidationFailed
from controlplane.urls_gateway import websocket_application
from fleet.models import Workload
from tests.support.gateway_stream import FINGERPRINT, Agent, open_stream, receive, workload
from tests.support.gateway_stream import enforced as _enforce
from tests.support.gateway_stream import stream_state as _state

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "protocol"


@pytest.fixture(autouse=True)
def gateway_fingerprint():
    from controlplane import runtime

    runtime.facts_set(gateway_fingerprint=FINGERPRINT)


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.json")), ids=lambda p: p.stem)
def test_golden_messages_decode_and_encode_byte_for_byte(path):
    text = path.read_text().strip()
    direction = protocol._REGISTRY[json.loads(text)["type"]].direction
    message = protocol.decode(text, sender=direction)
    assert message.encode() == text


def test_a_heartbeat_of_an_agent_before_flow_backlog_since_still_decodes():
    text = '{"clock":"c","owned_table":"absent","process_start_id":"p","type":"heartbeat","uptime_seconds":1.0,"v":1}'
    assert protocol.decode(text, sender="agent").flow_backlog_since is None


@pytest.mark.django_db(transaction=True)
def test_stream_opens_sends_a_snapshot_and_acknowledgement_synchronises():
    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent)
        welcome = await receive(communicator)
        assert isinstance(welcome, protocol.Welcome) and welcome.renew_only is False
        snapshot = await receive(communicator)
        assert isinstance(snapshot, protocol.Snapshot) and snapshot.mode == "visibility"
        state = await _state(agent)
        for _ in range(50):  # the send is recorded just after the frame leaves
            if state[1] is not None:
                break
            await asyncio.sleep(0.05)
            state = await _state(agent)
        assert state[0] == "pending" and state[1] is not None
        await communicator.send_to(text_data=protocol.Applied(version=snapshot.version).encode())
        await communicator.send_to(
            text_data=protocol.Heartbeat(
                process_start_id="p1", uptime_seconds=2, clock="x", owned_table="present"
            ).encode()
        )
        await communicator.receive_nothing(timeout=0.3)
        assert (await _state(agent))[0] == "synced"
        await communicator.disconnect()
        assert (await _state(agent))[0] == "offline"

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_s_flow_backlog_is_recorded_as_it_appears_and_clears_and_dropped_with_the_stream():
    """Heartbeats are written at most once a minute, but a backlog that appears or clears at once:
    coverage reads it. A stream's end forgets it (only a live stream says)."""
    agent = Agent()

    def heartbeat(backlog):
        return protocol.Heartbeat(
            process_start_id="p1",
            uptime_seconds=2,
            clock="x",
            owned_table="present",
            flow_backlog_since=backlog,
        ).encode()

    async def backlog():
        return (await database_sync_to_async(workload)(agent)).flow_backlog_since

    async def scenario():
        communicator = await open_stream(agent)
        await receive(communicator)
        await receive(communicator)
        await communicator.send_to(text_data=heartbeat(None))
        await communicator.receive_nothing(timeout=0.3)
        assert await backlog() is None
        await communicator.send_to(text_data=heartbeat("2026-11-27T10:00:00.250000Z"))
        await communicator.receive_nothing(timeout=0.3)
        assert await backlog() == datetime(2026, 11, 27, 10, 0, 0, 250000, tzinfo=UTC)
        await communicator.send_to(text_data=heartbeat(None))  # within the minute, yet written
        await communicator.receive_nothing(timeout=0.3)
        assert await backlog() is None
        await communicator.send_to(text_data=heartbeat("2026-11-27T10:01:00Z"))
        await communicator.receive_nothing(timeout=0.3)
        await communicator.disconnect()
        assert await backlog() is None
        malformed = await open_stream(agent)
        await receive(malformed)
        await receive(malformed)
        await malformed.send_to(text_data=heartbeat("10 o'clock"))
        closed = await malformed.receive_output(timeout=5)
        assert closed == {"type": "websocket.close", "code": protocol.CLOSE_MALFORMED}

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "overrides, code",
    [
        ({"workload_id": "00000000-0000-0000-0000-000000000000"}, protocol.CLOSE_UNAUTHENTICATED),
        ({"workload_id": "not-a-uuid"}, protocol.CLOSE_UNAUTHENTICATED),
        ({"proof": protocol.b64encode(b"x" * 64)}, protocol.CLOSE_UNAUTHENTICATED),
        ({"credential": '{"payload":"e30","signature":"AA"}'}, protocol.CLOSE_UNAUTHENTICATED),
    ],
)
def test_bad_auth_is_refused(overrides, code):
    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent, **overrides)
        output = await communicator.receive_output(timeout=5)
        assert output == {"type": "websocket.close", "code": code}

    async_to_sync(scenario)()
    assert workload(agent).sync_state == "offline"


@pytest.mark.django_db(transaction=True)
def test_an_impostor_key_is_refused():
    agent, impostor = Agent(), Ed25519PrivateKey.generate()
    agent.key = impostor  # right credential, wrong key: the proof cannot verify

    async def scenario():
        communicator = await open_stream(agent)
        assert await communicator.receive_output(timeout=5) == {
            "type": "websocket.close",
            "code": protocol.CLOSE_UNAUTHENTICATED,
        }

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "frame, code",
    [
        ("not json", protocol.CLOSE_MALFORMED),
        ('{"v":1,"type":"applied"}', protocol.CLOSE_MALFORMED),
        ('{"v":1,"type":"applied","version":"x","extra":1}', protocol.CLOSE_MALFORMED),
        ('{"v":9,"type":"applied","version":"x"}', protocol.CLOSE_VERSION),
        ('{"v":1,"type":"snapshot","version":"x","mode":"m","document":"d"}', protocol.CLOSE_UNEXPECTED),
        ('{"v":1,"type":"launch","missiles":true}', protocol.CLOSE_MALFORMED),
    ],
)
def test_malformed_or_unexpected_frames_close_the_stream_and_change_nothing(frame, code):
    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent)
        await receive(communicator)  # welcome
        await receive(communicator)  # snapshot
        before = await _state(agent)
        await communicator.send_to(text_data=frame)
        assert await communicator.receive_output(timeout=5) == {"type": "websocket.close", "code": code}
        await communicator.disconnect()
        return before

    before = async_to_sync(scenario)()
    assert before[0] == "pending"
    assert workload(agent).sync_state == "offline"


@pytest.mark.django_db(transaction=True)
def test_frames_before_auth_are_unexpected():
    async def scenario():
        communicator = WebsocketCommunicator(websocket_application, protocol.STREAM_PATH)
        await communicator.connect()
        await communicator.receive_from()
        await communicator.send_to(text_data=protocol.Applied(version="x").encode())
        assert await communicator.receive_output(timeout=5) == {
            "type": "websocket.close",
            "code": protocol.CLOSE_UNEXPECTED,
        }

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_failure_report_degrades_and_table_report_marks_removed():
    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent)
        await receive(communicator)
        snapshot = await receive(communicator)
        await communicator.send_to(
            text_data=protocol.Failed(version=snapshot.version, error="Error: boom").encode()
        )
        await communicator.send_to(text_data=protocol.TableState(state="absent").encode())
        await communicator.receive_nothing(timeout=0.3)
        await communicator.disconnect()

    async_to_sync(scenario)()
    w = workload(agent)
    assert w.sync_error == "Error: boom" and w.owned_table_state == "absent"


@pytest.mark.django_db(transaction=True)
def test_a_hand_edit_report_is_kept_on_the_workload_once_with_its_event():
    from controlplane.webhooks.models import WebhookEvent
    from controlplane.webhooks.services import webhook_create

    webhook_create(
        actor=CLI_ACTOR, data={"url": "https://hooks.example.com/x", "events": ["workload.table_modified"]}
    )
    agent = Agent()
    edit = protocol.TableModified(
        modified_at="2026-11-28T22:40:01.123000Z",
        restored_at="2026-11-28T22:40:01.181000Z",
        description="chain input: 1 rule added\x1b[31m",
    )

    async def scenario():
        communicator = await open_stream(agent)
        await receive(communicator)
        await receive(communicator)
        for _ in range(2):  # sent again on a later stream: the same edit, kept and announced once
            await communicator.send_to(text_data=edit.encode())
        bad = protocol.TableModified(modified_at="yesterday", restored_at=None, description="x")
        await communicator.send_to(text_data=bad.encode())
        assert (await communicator.receive_output(timeout=5))["code"] == protocol.CLOSE_MALFORMED

    async_to_sync(scenario)()
    w = workload(agent)
    assert clock.rfc3339(w.table_modified_at) == edit.modified_at
    assert clock.rfc3339(w.table_restored_at) == edit.restored_at
    assert w.table_modification.startswith("chain input: 1 rule added") and "\x1b" not in w.table_modification
    assert w.owned_table_state != "absent"  # an edit is not the kill switch
    (event,) = WebhookEvent.objects.filter(type="workload.table_modified")
    assert event.data["modified_at"] == edit.modified_at and event.data["restored_at"] == edit.restored_at


@pytest.mark.django_db(transaction=True)
def test_new_version_pushes_a_snapshot_and_resend_asks_the_agent_to_reconnect():
    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent)
        await receive(communicator)
        first = await receive(communicator)
        await communicator.send_to(text_data=protocol.Applied(version=first.version).encode())
        await database_sync_to_async(_enforce)(agent)
        second = await receive(communicator)
        assert (
            isinstance(second, protocol.Snapshot)
            and second.version != first.version
            and second.mode == "enforced"
        )
        await database_sync_to_async(_resend)(agent)
        assert isinstance(await receive(communicator), protocol.Reconnect)
        assert await communicator.receive_output(timeout=5) == {
            "type": "websocket.close",
            "code": protocol.CLOSE_RECONNECT,
        }

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_a_change_of_many_workloads_reaches_each_stream_with_one_message_to_each_process(monkeypatch):
    from channels.layers import get_channel_layer

    from fleet.push import FLEET_GROUP

    agents = [Agent(hostname=f"agent-{n}", address=f"10.0.0.{n}") for n in (1, 2, 3)]
    layer = get_channel_layer()
    groups_sent = []
    group_send = layer.group_send

    async def counted(group, message):
        groups_sent.append(group)
        await group_send(group, message)

    monkeypatch.setattr(layer, "group_send", counted)

    def all_enforced():
        from fleet.services import mode_change_create

        mode_change_create(actor=CLI_ACTOR, data={"selection": {"all": True}, "mode": "enforced"})

    async def scenario():
        streams = [await open_stream(agent) for agent in agents]
        for communicator in streams:
            await receive(communicator)
            first = await receive(communicator)
            await communicator.send_to(text_data=protocol.Applied(version=first.version).encode())
        await asyncio.sleep(0.2)  # the acknowledgements recorded
        groups_sent.clear()
        await database_sync_to_async(all_enforced)()
        for communicator in streams:
            snapshot = await receive(communicator)
            assert isinstance(snapshot, protocol.Snapshot) and snapshot.mode == "enforced"
        assert groups_sent == [FLEET_GROUP]
        for communicator in streams:
            await communicator.disconnect()

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_one_snapshot_is_unanswered_at_a_time_so_applied_of_a_repeated_version_means_the_table_holds_it():
    """Versions name documents: enforced -> simulation -> enforced repeats the first version. With the
    enforced snapshot unanswered, neither change sends another; its `applied` is then the truth (the
    agent holds the latest), and nothing more is sent. A change answered by `failed` sends the latest."""
    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent)
        await receive(communicator)
        first = await receive(communicator)
        await communicator.send_to(text_data=protocol.Applied(version=first.version).encode())
        await database_sync_to_async(_enforce)(agent)
        enforced = await receive(communicator)
        assert enforced.mode == "enforced"
        await database_sync_to_async(_mode)(agent, "simulation")
        await database_sync_to_async(_mode)(agent, "enforced")
        assert await communicator.receive_nothing(timeout=0.5)  # both wait for the answer
        await communicator.send_to(text_data=protocol.Applied(version=enforced.version).encode())
        assert await communicator.receive_nothing(timeout=0.5)  # the latest is what was answered
        workload_now = await database_sync_to_async(workload)(agent)
        assert workload_now.sync_state == "synced"
        assert workload_now.applied_version == workload_now.latest_policy_id == enforced.version

        await database_sync_to_async(_mode)(agent, "simulation")
        simulated = await receive(communicator)
        assert simulated.mode == "simulation"
        await database_sync_to_async(_mode)(agent, "enforced")
        assert await communicator.receive_nothing(timeout=0.5)
        await communicator.send_to(
            text_data=protocol.Failed(version=simulated.version, error="nft: busy").encode()
        )
        latest = await receive(communicator)  # the answer, a failure too, lets the latest go
        assert latest.version == enforced.version and latest.mode == "enforced"
        await communicator.disconnect()

    async_to_sync(scenario)()


def _mode(agent, mode):
    from fleet.services import mode_change_create

    mode_change_create(
        actor=CLI_ACTOR, data={"selection": {"workload_ids": [agent.workload_id]}, "mode": mode}
    )


def _resend(agent):
    from fleet.services import workload_resend_snapshot

    workload_resend_snapshot(actor=CLI_ACTOR, workload_id=agent.workload_id)


@pytest.mark.django_db(transaction=True)
def test_a_newer_stream_replaces_the_older():
    agent = Agent()

    async def scenario():
        old = await open_stream(agent)
        await receive(old)
        await receive(old)
        new = await open_stream(agent)
        assert await old.receive_output(timeout=5) == {
            "type": "websocket.close",
            "code": protocol.CLOSE_REPLACED,
        }
        await old.disconnect()  # the old stream's end must not take the workload offline
        await receive(new)
        await receive(new)
        assert (await _state(agent))[0] == "pending"
        await new.disconnect()

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_expired_credential_within_grace_may_renew_and_nothing_else(settings):
    agent = Agent()
    Workload.objects.filter(id=agent.workload_id).update(
        credential_expires_at=clock.now() - timedelta(hours=1)
    )

    async def scenario():
        communicator = await open_stream(agent)
        welcome = await receive(communicator)
        assert welcome.renew_only is True and welcome.credential_state == "expired"
        await communicator.send_to(
            text_data=protocol.Heartbeat(
                process_start_id="p", uptime_seconds=1, clock="c", owned_table="present"
            ).encode()
        )
        # A protocol violation, not "beyond grace": 4403 would make the agent give up for good.
        assert await communicator.receive_output(timeout=5) == {
            "type": "websocket.close",
            "code": protocol.CLOSE_UNEXPECTED,
        }
        again = await open_stream(agent)
        await receive(again)
        await again.send_to(text_data=protocol.Renew().encode())
        issued = await receive(again)
        assert isinstance(issued, protocol.CredentialIssued)
        assert await again.receive_output(timeout=5) == {
            "type": "websocket.close",
            "code": protocol.CLOSE_RECONNECT,
        }

    async_to_sync(scenario)()
    w = workload(agent)
    assert w.credential_last_late_renewal is not None and w.credential_serial == 2


@pytest.mark.django_db(transaction=True)
def test_a_renewal_that_fails_on_the_control_plane_side_closes_retryable_not_reenrol(monkeypatch):
    """A fault of ours (here the signing key cannot be read) must not tell the agent to re-enrol: 4403
    makes it exit for good. The stream closes with 4500, the failure is on the workload, and the next
    renewal, once the fault is gone, succeeds."""
    from fleet import credentials

    agent = Agent()
    real_issue = credentials.credential_issue

    def broken_issue(**kwargs):
        raise OSError(5, "Input/output error")

    async def renew_once():
        communicator = await open_stream(agent)
        await receive(communicator)  # welcome
        assert isinstance(await receive(communicator), protocol.Snapshot)
        await communicator.send_to(text_data=protocol.Renew().encode())
        return communicator

    async def scenario():
        monkeypatch.setattr(credentials, "credential_issue", broken_issue)
        communicator = await renew_once()
        assert await communicator.receive_output(timeout=5) == {
            "type": "websocket.close",
            "code": protocol.CLOSE_TRY_AGAIN,
        }
        monkeypatch.setattr(credentials, "credential_issue", real_issue)
        again = await renew_once()
        assert isinstance(await receive(again), protocol.CredentialIssued)
        await again.disconnect()

    async_to_sync(scenario)()
    w = workload(agent)
    assert w.credential_serial == 2 and w.credential_renewal_failed is False


@pytest.mark.django_db(transaction=True)
def test_a_failed_renewal_is_recorded_on_the_workload(monkeypatch):
    from fleet import credentials

    agent = Agent()
    monkeypatch.setattr(credentials, "credential_issue", lambda **kwargs: 1 / 0)

    async def scenario():
        communicator = await open_stream(agent)
        await receive(communicator)  # welcome
        assert isinstance(await receive(communicator), protocol.Snapshot)
        await communicator.send_to(text_data=protocol.Renew().encode())
        assert (await communicator.receive_output(timeout=5))["code"] == protocol.CLOSE_TRY_AGAIN

    async_to_sync(scenario)()
    w = workload(agent)
    assert w.credential_renewal_failed is True
    assert w.credential_last_error == "the control plane failed to renew: ZeroDivisionError"


@pytest.mark.django_db(transaction=True)
def test_credential_beyond_grace_is_refused():
    agent = Agent()
    Workload.objects.filter(id=agent.workload_id).update(
        credential_expires_at=clock.now() - timedelta(days=30)
    )

    async def scenario():
        communicator = await open_stream(agent)
        assert await communicator.receive_output(timeout=5) == {
            "type": "websocket.close",
            "code": protocol.CLOSE_FORBIDDEN,
        }

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_an_agents_control_characters_are_stored_escaped_and_shown_harmlessly():
    """A compromised agent's version, apply error, applied version and renewal error carry ESC
    sequences, BEL, CR, NUL, C1 and bidi overrides: each is stored escaped, and no command shows any
    raw. At enrolment such a version is refused."""
    from fleet.enrolment import enrolment_input
    from tests.support.helpers import run_command
    from tests.support.hostile_text import HOSTILE_TEXT, assert_shown_harmlessly, unsafe_in

    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent, agent_version=HOSTILE_TEXT[:60])
        await receive(communicator)
        snapshot = await receive(communicator)
        for message in (
            protocol.Failed(version=snapshot.version, error=HOSTILE_TEXT),
            protocol.Applied(version=HOSTILE_TEXT[:60]),
            protocol.RenewalFailed(error=HOSTILE_TEXT),
        ):
            await communicator.send_to(text_data=message.encode())
        await communicator.receive_nothing(timeout=0.3)
        await communicator.disconnect()

    async_to_sync(scenario)()
    w = workload(agent)
    assert w.sync_error.startswith("\\x1b[2J\\x1b[H\\x1b]0;pwned\\x07ok\\x0dforged")
    assert "two\nlines\tx" in w.sync_error  # an error's own lines stay lines
    for text in (w.agent_version, w.applied_version, w.sync_error, w.credential_last_error):
        assert not unsafe_in(text, layout="\n\t"), text
    for args in (
        ["list"],
        ["show", agent.workload_id],
        ["list", "--json"],
        ["show", agent.workload_id, "--json"],
    ):
        code, out, err = run_command("workload", *args)
        assert code == 0, err
        assert_shown_harmlessly(out + err)
    with pytest.raises(ValidationFailed) as refused:
        enrolment_input(
            public_key=public_key_encode(agent.key.public_key()),
            hostname="agent-1",
            addresses=["10.0.0.7"],
            agent_version="1.0\x1b]0;pwned\x07",
        )
    assert [(f.path, f.rule) for f in refused.value.findings] == [("/agent_version", "control-characters")]
    for hostname in ("web\x1b[2J", "web\u202e", "web\r", "web\x00"):  # a DNS-style name already
        with pytest.raises(ValidationFailed) as refused:
            enrolment_input(public_key=public_key_encode(agent.key.public_key()), hostname=hostname,
                            addresses=["10.0.0.7"], agent_version="1.0")  # fmt: skip
        assert [f.rule for f in refused.value.findings] == ["hostname"]
        assert not unsafe_in(refused.value.findings[0].message)  # the refusal quotes it escaped


@pytest.mark.django_db(transaction=True)
def test_a_stream_without_its_database_closes_with_4503_not_an_exception(caplog):
    from django.db import connection

    from fleet import held_streams
    from tests.support.serve_process import free_port

    agent = Agent()
    if connection.vendor == "postgresql":
        held_streams.db_pool_close_connections()  # their next call connects, and fails
    saved, kept = dict(connection.settings_dict), connection.connection
    connection.connection = None
    if connection.vendor == "postgresql":
        connection.settings_dict.update(HOST="127.0.0.1", PORT=str(free_port()))
    else:
        connection.settings_dict["NAME"] = "/nonexistent-palisade-dir/palisade.sqlite3"

    async def scenario():
        communicator = await open_stream(agent)
        output = await communicator.receive_output(timeout=10)
        assert output["type"] == "websocket.close" and output["code"] == protocol.CLOSE_SHUTDOWN
        assert re.fullmatch(r"database unavailable: retry after ([5-9]|1[0-5]) s", output["reason"])
        await communicator.wait(timeout=5)  # the consumer ended without an exception

    try:
        async_to_sync(scenario)()
    finally:
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)
        connection.connection = kept
        if connection.vendor == "postgresql":
            held_streams.db_pool_close_connections()
    assert not any(r.exc_info for r in caplog.records)
    assert any("database unavailable: cannot serve agent streams" in r.getMessage() for r in caplog.records)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_gateway_thread_idle_through_an_outage_drops_its_dead_connection_before_using_it():
    """Its connection was ended by the server (here: terminated, as a stopping server ends them all);
    after an outage the next call checks it first instead of failing once more."""
    import threading

    from django.db import connection

    from controlplane.outage import outage
    from fleet import held_streams
    from tests.support.requirements import require
    from tests.support.serve_process import free_port

    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    pids: set[int] = set()
    everyone = threading.Barrier(held_streams.DB_THREADS)

    def backend_pid():
        connection.ensure_connection()
        pids.add(connection.connection.info.backend_pid)
        everyone.wait(10)  # one call per thread: every pool thread has a connection

    async def on_every_thread():
        await asyncio.gather(*(held_streams.db(backend_pid)() for _ in range(held_streams.DB_THREADS)))

    async_to_sync(on_every_thread)()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", [sorted(pids)])
    refused = psycopg_refused(free_port())
    outage.failed("serve agent streams", refused)  # an outage began, elsewhere in the process
    outage.available()

    async def count():
        return await held_streams.db(lambda: Workload.objects.count())()

    try:
        assert async_to_sync(count)() == 0
    finally:
        held_streams.db_pool_close_connections()


def psycopg_refused(port):
    import psycopg

    try:
        psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/x")
    except psycopg.OperationalError as error:
        return error
    raise AssertionError("a closed port accepted a connection")


@pytest.mark.django_db(transaction=True)
def test_the_table_state_of_auth_is_recorded_with_the_stream_in_one_transaction(monkeypatch):
    """A reconnect records its owned table's state with the stream it opens: a transaction and a row
    lock fewer for each of the thousands of agents a survivor takes at once after a failover. The
    state and its event are as a `table` report would leave them."""
    from fleet import sync

    reported, events = [], []
    monkeypatch.setattr(sync, "workload_table_reported", lambda **kwargs: reported.append(kwargs))
    recorded = sync.webhook_events_record
    monkeypatch.setattr(sync, "webhook_events_record", lambda found: recorded(events.extend(found) or found))
    agent = Agent()

    async def scenario():
        communicator = await open_stream(agent, owned_table="absent")
        await receive(communicator)
        await receive(communicator)
        await communicator.disconnect()

    async_to_sync(scenario)()
    assert reported == []
    assert workload(agent).owned_table_state == "absent"
    assert [event.type for event in events][:1] == ["workload.enforcement_removed"]  # then offline

"""serve's tuning of the websocket stack: autobahn's debug arguments (controlplane/websocket_tuning.py) and
daphne's walk of every connection (the serve command's _Server)."""

import pprint

import autobahn.util
import autobahn.websocket.protocol
import pytest

from controlplane.websocket_tuning import websocket_debug_arguments_cheapen


@pytest.fixture
def autobahn_as_shipped(monkeypatch):
    # The names the tuning replaces are autobahn's own module globals: an upgrade that renamed them
    # would leave the tuning setting names nobody reads, and this fails first.
    assert autobahn.websocket.protocol.pformat is pprint.pformat
    assert isinstance(autobahn.util._HAS_CLICK, bool)
    monkeypatch.setattr(autobahn.websocket.protocol, "pformat", pprint.pformat)
    monkeypatch.setattr(autobahn.util, "_HAS_CLICK", autobahn.util._HAS_CLICK)


def test_a_connections_settings_are_stated_by_repr_not_pretty_printed(autobahn_as_shipped):
    settings = [("openHandshakeTimeout", 5, "WebSocketServerFactory")] * 40
    assert "\n" in autobahn.websocket.protocol.pformat(settings)
    websocket_debug_arguments_cheapen()
    assert autobahn.websocket.protocol.pformat(settings) == repr(settings)


def test_debug_arguments_are_not_styled_for_a_terminal(autobahn_as_shipped):
    assert autobahn.util._HAS_CLICK  # the test venv has click (import-linter and schemathesis need it)
    assert autobahn.util.hlval("peer") != "peer"  # click's colours
    websocket_debug_arguments_cheapen()
    assert autobahn.util.hlval("peer") == "peer"
    assert autobahn.util.hltype(test_debug_arguments_are_not_styled_for_a_terminal).endswith(
        "test_debug_arguments_are_not_styled_for_a_terminal>"
    )


def test_daphnes_walk_of_every_connection_runs_every_fifth_second(monkeypatch):
    import daphne.server
    from twisted.internet import reactor

    from controlplane.management.commands.serve import APPLICATION_CHECK_SECONDS, _Server

    walks, later = [], []
    monkeypatch.setattr(daphne.server.Server, "application_checker", lambda server: walks.append(server))
    monkeypatch.setattr(reactor, "callLater", lambda seconds, call: later.append((seconds, call)))
    server = _Server.__new__(_Server)  # nothing listens: only the checker's pace is under test
    for _ in range(2 * APPLICATION_CHECK_SECONDS):
        server.application_checker()
    assert walks == [server, server]  # daphne's walk, which reschedules itself, every fifth call
    assert later == [(1, server.application_checker)] * (2 * APPLICATION_CHECK_SECONDS - 2)

"""serve gives a websocket upgrade it has taken as long to be accepted as the agent waits for its stream
to open. daphne's own handshake time (5 s, on autobahn's timer rounded down to whole seconds) dropped
the connection without an HTTP answer when the application was slower than that to accept, which a
loaded serve can be: the agent saw "did not receive a valid HTTP response" after paying for TLS."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from websockets.exceptions import InvalidMessage
from websockets.sync.client import connect

from agent.daemon import HANDSHAKE_SECONDS
from controlplane.management.commands import serve
from tests.support.serve_process import REPO, free_port, terminate

ACCEPT_AFTER_SECONDS = 6  # past daphne's 4-5 s, within the agent's 10 s

# serve's daphne server class, or daphne's own, in front of an application slow to accept a websocket.
SERVER = """
import asyncio, sys
import django
django.setup()
from daphne.server import Server
from controlplane.management.commands.serve import _Server

async def application(scope, receive, send):
    if scope["type"] == "lifespan":
        return
    await receive()  # websocket.connect
    await asyncio.sleep(float(sys.argv[3]))
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": "accepted"})
    await receive()

server_class = _Server if sys.argv[1] == "serve" else Server
server_class(application, endpoints=[f"tcp:port={sys.argv[2]}:interface=127.0.0.1"], signal_handlers=False).run()
"""


def _server(kind: str, port: int, tmp_path) -> subprocess.Popen:
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="controlplane.settings", PALISADE_DATA_DIR=str(tmp_path))
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, kind, str(port), str(ACCEPT_AFTER_SECONDS)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            if process.poll() is not None:
                raise AssertionError(f"the {kind} server ended: {process.stderr.read()[-2000:]}") from None
            if time.monotonic() > deadline:
                terminate(process)
                raise AssertionError(f"the {kind} server did not listen within 60 s") from None
            time.sleep(0.1)


def _open(port: int) -> str:
    with connect(f"ws://127.0.0.1:{port}/", open_timeout=HANDSHAKE_SECONDS) as ws:
        return ws.recv(timeout=5)


def test_an_upgrade_serve_took_waits_for_a_slow_accept(tmp_path):
    assert serve.UPGRADE_ACCEPT_SECONDS >= HANDSHAKE_SECONDS > ACCEPT_AFTER_SECONDS
    port = free_port()
    process = _server("serve", port, tmp_path)
    try:
        assert _open(port) == "accepted"
    finally:
        terminate(process)


def test_daphnes_own_handshake_time_drops_it_without_an_answer(tmp_path):
    # Why serve sets its own: if daphne's default ever waits long enough, this says so.
    port = free_port()
    process = _server("daphne", port, tmp_path)
    try:
        with pytest.raises(InvalidMessage, match="did not receive a valid HTTP response"):
            _open(port)
    finally:
        terminate(process)


def test_a_handshake_time_given_to_the_server_still_wins():
    server = serve._Server(application=None, endpoints=["tcp:port=0"], websocket_handshake_timeout=3)
    assert server.websocket_handshake_timeout == 3

"""A worker process of serve for heavy requests (controlplane/heavy_pool.py explains which and why).

    python -m controlplane.heavy_worker FD

serve starts it with one end of a socket pair as FD, and its own environment (the same settings and
database). It lowers its CPU priority, takes serve's runtime facts, sets Django up, says it is ready,
then answers one request at a time with Django's whole handler until serve closes the socket. Its
PostgreSQL statements time out at the heavy requests' deadline, at which serve kills it anyway; an
answer over the size bound is replaced by the problem that says so. It logs to the stderr it shares
with serve (the access log line of each request included).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

log = logging.getLogger("palisade.heavy")


def main(argv: list[str]) -> int:
    # serve ends its workers itself (it closes their sockets); a Ctrl-C meant for serve must not
    # interrupt a request half answered.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from django.conf import settings

    os.nice(settings.PALISADE_HEAVY_NICE)  # before Django's start, which is most of a worker's CPU
    connection = Connection(int(argv[1]))
    facts = connection.recv_bytes()

    import django

    django.setup(set_prefix=False)

    from django.core.handlers.wsgi import WSGIHandler
    from django.db import connections
    from django.urls import resolve

    from controlplane import heavy_pool, runtime

    runtime.facts_set(**heavy_pool.facts_decode(facts))
    _database_options(connections["default"].settings_dict, settings.PALISADE_HEAVY_DEADLINE_SECONDS)
    handler = WSGIHandler()
    resolve("/api/v1/me")  # imports every view now, not in the first request's time
    limit = settings.PALISADE_HEAVY_MAX_ANSWER_BYTES
    connection.send_bytes(b'{"ready": %d}' % os.getpid())

    while True:
        try:
            head = connection.recv_bytes()
            body = connection.recv_bytes()
        except EOFError:
            break
        environ = heavy_pool.request_decode(head, body)
        answer = heavy_pool.django_answer(handler, environ)
        if len(answer[2]) > limit:
            path = environ.get("PATH_INFO", "")
            log.warning(
                "the answer to %s is %d bytes, over the %d of a heavy request", path, len(answer[2]), limit
            )
            answer = heavy_pool.too_large_answer(path, len(answer[2]), limit)
        for part in heavy_pool.answer_encode(answer):
            connection.send_bytes(part)
    connections.close_all()
    return 0


APPLICATION_NAME = "palisade heavy worker"


def _database_options(database: dict, seconds: float) -> None:
    """PostgreSQL stops a statement at the deadline too: a worker killed there may have left one
    running, or waiting on a lock, which the server would otherwise finish for nobody. The workers'
    sessions carry their own name in pg_stat_activity."""
    if database["ENGINE"] != "django.db.backends.postgresql":
        return
    options = database.setdefault("OPTIONS", {})
    options["options"] = f"{options.get('options', '')} -c statement_timeout={int(seconds * 1000)}".strip()
    options["application_name"] = APPLICATION_NAME


def run(argv: list[str]) -> int:
    """serve may be gone before its worker is ready (its port was in use, an operator's Ctrl-C): the
    worker then has no one to answer and leaves quietly, not with a traceback in serve's error output."""
    try:
        return main(argv)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv))

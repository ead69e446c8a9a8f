"""Helpers several test modules share: host commands as a script sees them, and racing writers."""

import io
import sys
import threading

from django.core.management import call_command
from django.db import connections


def run_command(*args, stdin_text: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    """A manage.py command: its exit status, standard output and standard error."""
    out, err = io.StringIO(), io.StringIO()
    if stdin_text is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin_text))
    code = 0
    try:
        call_command(*args, stdout=out, stderr=err)
    except SystemExit as exit:
        code = exit.code
    return code, out.getvalue(), err.getvalue()


def race(*calls) -> list:
    """Run the calls at the same instant, each on its own thread and database connection; a call
    that raises gives its exception as its result."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def run_one(index, call):
        try:
            barrier.wait()
            results[index] = call()
        except Exception as error:  # noqa: BLE001  (the outcome is what the tests compare)
            results[index] = error
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run_one, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


PROBLEM = "application/problem+json"


def assert_problem(response, status, name):
    assert response.status_code == status, response.content
    assert response["Content-Type"] == PROBLEM
    body = response.json()
    assert body["type"] == f"urn:service:problem:{name}"
    assert body["status"] == status
    assert body["title"] and body["detail"]
    return body

"""Heavy requests run in worker processes that serve starts, never in serve's own interpreter.

A request is heavy when its work grows with the stored flows, the fleet or its body rather than with a
page: render dry-runs, policy impacts, suggestions, selector previews, flow rollups and simulation
reviews (`HEAVY_PATHS`), and the console's CSV exports, which read every row (`EXPORT_PAGES`). On a
thread of serve such work shares the interpreter lock with the event loop that holds every agent's
stream: ten suggestions over 320,000 stored keys held `GET /me` for 5 s at p95 beside 2,000 agents, and
on a busy machine most of the agents' streams missed their keepalives (docs/benchmarks.md).

serve keeps PALISADE_HEAVY_WORKERS worker processes (`python -m controlplane.heavy_worker`), started
with it at a lower CPU priority (PALISADE_HEAVY_NICE) so that on a small machine the event loop wins
the CPU. Each worker runs Django's whole handler on the request it is given (middleware,
authentication, the cross-origin guard, the view, problem documents, audit, the access log line), as a
pool thread of serve would; serve counts the answer in its own metrics. On serve's side, one thread per
worker takes the requests in arrival order from one queue, sends each over a socket pair and waits for
its answer:

- at most PALISADE_HEAVY_WAITING requests wait beyond those running; one more is refused at once with
  429 `rate-limited` and Retry-After;
- a request still running after PALISADE_HEAVY_DEADLINE_SECONDS is answered 504 `deadline-exceeded`;
  its worker is killed and another started (a worker's PostgreSQL statements time out at the same
  deadline, so the database stops the work too);
- an answer over PALISADE_HEAVY_MAX_ANSWER_BYTES is not sent: the worker answers 422
  `answer-too-large` instead;
- a worker that dies (killed, out of memory) is started again: at once when it was answering (which
  gets 500 `internal`), within a second when it was idle.

The console reaches the API in process (controlplane/console/client.py): inside serve it sends its heavy
calls through this same pool (`current()`), so a console page waits for a worker as any client does.
Inside a worker, and in commands and tests, there is no pool and everything runs in process.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from urllib.parse import parse_qs

from django.conf import settings

from controlplane import metrics, runtime
from controlplane.problems import Problem

log = logging.getLogger("palisade.serve")

HEAVY_PATHS = frozenset(
    {
        "/api/v1/policies/render-dryrun",
        "/api/v1/policies/impact",
        "/api/v1/policies/suggestions",
        "/api/v1/selectors/preview",
        "/api/v1/flows/rollup",
        "/api/v1/flows/review",
    }
)
# Console pages that answer with every row of a read as a CSV file when asked for an `export`.
EXPORT_PAGES = frozenset({"/flows"})
START_TIMEOUT_SECONDS = 60.0  # a worker's Django start, loading every view; slow on a busy machine
IDLE_CHECK_SECONDS = 1.0
STOP_GRACE_SECONDS = 5.0
RETRY_FIRST_SECONDS, RETRY_LAST_SECONDS = 1.0, 60.0  # between tries to start a worker that failed to
REPO = Path(__file__).resolve().parent.parent

Answer = tuple[int, list[tuple[str, str]], bytes]


def is_heavy(path: str, query: str = "") -> bool:
    if path in HEAVY_PATHS:
        return True
    return path in EXPORT_PAGES and "export" in parse_qs(query)


def settings_problem() -> str | None:
    """What is wrong with the PALISADE_HEAVY_* settings, for serve to refuse to start with."""
    if settings.PALISADE_HEAVY_WORKERS < 1:
        return "PALISADE_HEAVY_WORKERS must be at least 1"
    if settings.PALISADE_HEAVY_WAITING < 0:
        return "PALISADE_HEAVY_WAITING must be 0 or more"
    if settings.PALISADE_HEAVY_DEADLINE_SECONDS <= 0:
        return "PALISADE_HEAVY_DEADLINE_SECONDS must be above 0"
    if settings.PALISADE_HEAVY_MAX_ANSWER_BYTES < 1024:
        return "PALISADE_HEAVY_MAX_ANSWER_BYTES must be at least 1024"
    return None


# --- answers and what travels between serve and a worker ---


def problem_answer(problem: Problem, *, instance: str | None = None) -> Answer:
    document = json.dumps(problem.document(instance=instance)).encode()
    # As every answer but the static files (controlplane/response_headers.py): not for any cache.
    headers = [
        ("Content-Type", "application/problem+json"),
        ("Cache-Control", "no-store"),
        *problem.headers.items(),
    ]
    return problem.status, headers, document


def busy_answer(path: str) -> Answer:
    return problem_answer(
        Problem(
            "rate-limited",
            "Too many heavy requests (render dry-runs, impacts, suggestions, selector previews, flow "
            "rollups and reviews, exports) are running or waiting; retry in a second.",
            headers={"Retry-After": "1"},
            retry_after=1,
        ),
        instance=path,
    )


def deadline_answer(path: str, deadline: float) -> Answer:
    return problem_answer(
        Problem(
            "deadline-exceeded",
            f"The request ran past the {deadline:g} s deadline of heavy requests "
            "(PALISADE_HEAVY_DEADLINE_SECONDS) and was stopped; nothing was changed. Narrow its range "
            "or selection.",
            deadline_seconds=deadline,
        ),
        instance=path,
    )


def too_large_answer(path: str, size: int, limit: int) -> Answer:
    return problem_answer(
        Problem(
            "answer-too-large",
            f"The answer is {size} bytes, over the {limit} bytes a heavy request may answer "
            "(PALISADE_HEAVY_MAX_ANSWER_BYTES); nothing was sent. Narrow its range or selection.",
            max_bytes=limit,
        ),
        instance=path,
    )


def stopping_answer(path: str) -> Answer:
    return problem_answer(
        Problem(
            "service-unavailable",
            "serve is stopping; retry in a few seconds.",
            headers={"Retry-After": "5"},
            retry_after=5,
        ),
        instance=path,
    )


def failed_answer(path: str) -> Answer:
    return problem_answer(
        Problem("internal", "The worker process answering the request failed; see the host's log."),
        instance=path,
    )


def django_answer(handler, environ: dict) -> Answer:
    """Django's WSGI handler run whole on one request: its status, headers and body."""
    started: list = []

    def start_response(status, headers, exc_info=None):
        started[:] = [status, headers]

    result = handler(environ, start_response)
    try:
        body = b"".join(result)
    finally:
        close = getattr(result, "close", None)
        if close:
            close()
    status, headers = started
    return int(status.split(" ", 1)[0]), headers, body


def request_encode(environ: dict, body: bytes) -> tuple[bytes, bytes]:
    """The request as it crosses to a worker: the environ's text entries (CGI variables, the listener),
    and the body as it was received."""
    text = {key: value for key, value in environ.items() if isinstance(value, str)}
    return json.dumps(text).encode(), body


def request_decode(head: bytes, body: bytes) -> dict:
    environ = json.loads(head)
    environ.update(
        {
            "wsgi.version": (1, 0),
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": False,
            "wsgi.multiprocess": True,
            "wsgi.run_once": False,
        }
    )
    return environ


def answer_encode(answer: Answer) -> tuple[bytes, bytes]:
    status, headers, body = answer
    return json.dumps({"status": status, "headers": [list(pair) for pair in headers]}).encode(), body


def answer_decode(head: bytes, body: bytes) -> Answer:
    decoded = json.loads(head)
    return int(decoded["status"]), [(str(k), str(v)) for k, v in decoded["headers"]], body


def facts_encode() -> bytes:
    """serve's runtime facts (site label, retention, gateway): a worker answers with the same ones."""
    facts = dataclasses.asdict(runtime.facts)
    facts["listener_ports"] = {str(port): name for port, name in facts["listener_ports"].items()}
    return json.dumps(facts).encode()


def facts_decode(data: bytes) -> dict:
    facts = json.loads(data)
    facts["listener_ports"] = {int(port): name for port, name in facts["listener_ports"].items()}
    return facts


# --- serve's side ---


@dataclass
class _Job:
    path: str
    head: bytes
    body: bytes
    future: Future


class _WorkerDied(Exception):
    pass


class _NoAnswerInTime(Exception):  # not TimeoutError: that is an OSError, as a dead worker's socket raises
    pass


class _Worker:
    """One worker process and serve's end of its socket pair."""

    def __init__(self, command: list[str]):
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [*command, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=_worker_env(),
            )
        finally:
            theirs.close()
        self.connection = Connection(ours.detach())

    @property
    def pid(self) -> int:
        return self.process.pid

    def exited(self) -> int | None:
        return self.process.poll()

    def start(self, timeout: float) -> None:
        self.connection.send_bytes(facts_encode())
        self._receive(time.monotonic() + timeout)  # {"ready": pid}

    def ask(self, job: _Job, deadline: float) -> Answer:
        try:
            self.connection.send_bytes(job.head)
            self.connection.send_bytes(job.body)
        except OSError as error:
            raise _WorkerDied(str(error) or type(error).__name__) from None
        head = self._receive(deadline)
        return answer_decode(head, self._receive(deadline))

    def _receive(self, deadline: float) -> bytes:
        try:
            ready = self.connection.poll(max(0.0, deadline - time.monotonic()))
            # The worker bounds its answers; more than that bound is a fault, not an answer.
            data = (
                self.connection.recv_bytes(settings.PALISADE_HEAVY_MAX_ANSWER_BYTES + 64 * 1024)
                if ready
                else None
            )
        except (EOFError, OSError) as error:
            raise _WorkerDied(str(error) or type(error).__name__) from None
        if data is None:
            raise _NoAnswerInTime
        return data

    def kill(self) -> int:
        """Ends the process at once; its exit status (negative: the signal)."""
        try:
            self.process.kill()
        except ProcessLookupError:
            pass
        self.connection.close()
        return self.process.wait()

    def stop(self, grace: float) -> None:
        """Its socket closed, an idle worker exits; one still answering is killed after `grace`."""
        self.connection.close()
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _worker_env() -> dict:
    env = dict(os.environ)
    # The data directory as serve resolved it (a relative --data-dir is relative to serve's start).
    env["PALISADE_DATA_DIR"] = str(settings.DATA_DIR)
    env["DJANGO_SETTINGS_MODULE"] = os.environ.get("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


class _Slot(threading.Thread):
    """A thread of serve that keeps one worker running and hands it one request at a time."""

    def __init__(self, pool: HeavyPool, number: int):
        super().__init__(name=f"heavy-{number}", daemon=True)
        self.pool = pool
        self.worker: _Worker | None = None
        self.retry_at = 0.0
        self.retry_wait = RETRY_FIRST_SECONDS

    def run(self) -> None:
        self._ensure_worker()
        while True:
            try:
                job = self.pool.jobs.get(timeout=IDLE_CHECK_SECONDS)
            except queue.Empty:
                if self.pool.stopping.is_set():
                    break
                self._ensure_worker()
                continue
            if job is None:
                break
            if not job.future.set_running_or_notify_cancel():  # its client left while it waited
                continue
            if self.pool.stopping.is_set():
                job.future.set_result(stopping_answer(job.path))
            else:
                job.future.set_result(self._answer(job))
        if self.worker is not None:
            self.worker.stop(STOP_GRACE_SECONDS)
            self.worker = None

    def _ensure_worker(self) -> _Worker | None:
        """The running worker, or a new one when it exited; None when one cannot start."""
        if self.worker is not None:
            code = self.worker.exited()
            if code is None:
                return self.worker
            log.warning("heavy worker %d exited (%s); starting another", self.worker.pid, _status(code))
            self.worker.kill()
            self.worker = None
        if self.pool.stopping.is_set() or time.monotonic() < self.retry_at:
            return None
        try:
            worker = _Worker(self.pool.command)
        except OSError as error:
            self._failed_to_start(f"cannot start a heavy worker: {error}")
            return None
        try:
            worker.start(self.pool.start_timeout)
        except (_NoAnswerInTime, _WorkerDied) as error:
            code = worker.kill()
            why = (
                f"no answer within {self.pool.start_timeout:g} s"
                if isinstance(error, _NoAnswerInTime)
                else error
            )
            self._failed_to_start(
                f"a heavy worker did not start ({why}, {_status(code)}); see its lines above"
            )
            return None
        self.worker, self.retry_wait = worker, RETRY_FIRST_SECONDS
        log.info("heavy worker %d started", worker.pid)
        return worker

    def _failed_to_start(self, message: str) -> None:
        # Until one starts, heavy requests are answered 500 at once; tries are spaced out, not every second.
        log.error("%s; trying again in %g s", message, self.retry_wait)
        self.retry_at = time.monotonic() + self.retry_wait
        self.retry_wait = min(self.retry_wait * 2, RETRY_LAST_SECONDS)

    def _answer(self, job: _Job) -> Answer:
        worker = self._ensure_worker()
        if worker is None:
            return failed_answer(job.path)
        deadline = self.pool.deadline
        try:
            return worker.ask(job, time.monotonic() + deadline)
        except _NoAnswerInTime:
            code = worker.kill()
            self.worker = None
            log.warning(
                "heavy request %s ran past its %g s deadline: worker %d stopped (%s), another starts",
                job.path,
                deadline,
                worker.pid,
                _status(code),
            )
            return deadline_answer(job.path, deadline)  # the next worker starts after this is answered
        except _WorkerDied as error:
            code = worker.kill()
            self.worker = None
            log.error(
                "heavy worker %d failed while answering %s (%s: %s); starting another",
                worker.pid,
                job.path,
                _status(code),
                error,
            )
            return failed_answer(job.path)


def _status(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class HeavyPool:
    """serve's worker processes for heavy requests. `submit` from any thread; `stop` once, at shutdown."""

    def __init__(
        self,
        *,
        workers: int | None = None,
        waiting: int | None = None,
        deadline: float | None = None,
        start_timeout: float = START_TIMEOUT_SECONDS,
    ):
        self.workers = workers if workers is not None else settings.PALISADE_HEAVY_WORKERS
        self.limit = self.workers + (waiting if waiting is not None else settings.PALISADE_HEAVY_WAITING)
        self.deadline = deadline if deadline is not None else settings.PALISADE_HEAVY_DEADLINE_SECONDS
        self.command = [sys.executable, "-m", "controlplane.heavy_worker"]
        self.start_timeout = start_timeout
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self.admitted = 0  # running or waiting
        self.slots = [_Slot(self, number) for number in range(1, self.workers + 1)]

    def start(self) -> HeavyPool:
        metrics.HEAVY_REQUESTS.set_function(lambda: self.admitted)
        for slot in self.slots:
            slot.start()
        return self

    def submit(self, environ: dict, body: bytes) -> Future | None:
        """The answer's future, or None when as many requests as admitted are running or waiting."""
        with self._lock:
            if self.stopping.is_set() or self.admitted >= self.limit:
                return None
            self.admitted += 1
        future: Future = Future()
        future.add_done_callback(self._released)
        head, body = request_encode(environ, body)
        self.jobs.put(_Job(environ.get("PATH_INFO", ""), head, body, future))
        return future

    def answer(self, environ: dict, body: bytes) -> Answer:
        """`submit` and wait: for a thread (the console's client) rather than the event loop."""
        future = self.submit(environ, body)
        if future is None:
            return busy_answer(environ.get("PATH_INFO", ""))
        return future.result()

    def _released(self, _future: Future) -> None:
        with self._lock:
            self.admitted -= 1

    def stop(self) -> None:
        """At serve's shutdown: refuse new requests and those waiting, give the running ones a few
        seconds, then end the workers."""
        self.stopping.set()
        for _ in self.slots:
            self.jobs.put(None)
        until = time.monotonic() + STOP_GRACE_SECONDS
        for slot in self.slots:
            slot.join(max(0.0, until - time.monotonic()))
        for slot in self.slots:
            worker = slot.worker
            if slot.is_alive() and worker is not None:
                worker.process.kill()  # its slot sees the socket close and ends
        for slot in self.slots:
            slot.join(STOP_GRACE_SECONDS)


_current: HeavyPool | None = None


def current() -> HeavyPool | None:
    """This process's pool: serve's, once installed; None in a worker, a command or a test."""
    return _current


def install(pool: HeavyPool | None) -> None:
    global _current
    _current = pool

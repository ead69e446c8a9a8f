"""Request bodies, decided on when a request's headers are in and before serve receives its body.

daphne hands a request to the application only once Twisted has received the whole body (into a
temporary file from 100 KB on), and the HTTP entry then holds it in memory for Django. Anything that
should refuse a body without reading it must therefore run here, on the HTTP channel:

- a body over its path's limit is 413 `payload-too-large` at once: a Content-Length over it, or a
  chunked body as soon as it streams past it;
- on the gateway listener, a view's `headers_check` (flow reports: an enrolled workload presenting its
  current, unexpired credential; flows/gateway.py) runs on a thread of its own while the channel reads
  nothing more of the body; a refusal is the problem document the view would give. Headers the check
  passed (by the view's `headers_check_key`) pass again for PASSED_SECONDS without it: the check cost
  serve more CPU than the rest of a small report. The view still checks every report in full, so a
  credential renewed, expired or revoked meanwhile only has its body read before it is refused;
- on the operator listener, every body but a login's needs a credential first (an operator token or a
  live session cookie; controlplane/auth/authentication.py's `operator_credential_check`, run the same
  way): whoever holds none is refused 401 unread, so cannot hold the budget that operators' writes need.
  A login's body (`POST /api/v1/session`, the console's `/login`) is at most LOGIN_BODY_BYTES, from a
  budget of its own (LOGIN_BUDGET_BYTES): a flood of them can delay logins, not writes;
- the bytes of bodies in flight, from when a body is admitted until its request is answered, are bounded
  per listener (`PALISADE_GATEWAY_BODY_BUDGET_BYTES`, `PALISADE_OPERATOR_BODY_BUDGET_BYTES`): a body the
  budget has no room for is 503 `service-unavailable` with Retry-After. A body of unknown length takes
  its bytes as they arrive.

A refused request's connection closes (`Connection: close`). The client may still be sending its body,
so the channel reads and discards what follows for up to LINGER_SECONDS: it then reads the answer
instead of a reset.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import unquote

from django.conf import settings
from django.db import close_old_connections
from django.urls import Resolver404, resolve
from django.utils.datastructures import CaseInsensitiveMapping

from controlplane.api.errors import service_unavailable
from controlplane.auth.authentication import operator_credential_check
from controlplane.listeners import GATEWAY, OPERATOR, body_limit, listener_for_port
from controlplane.outage import database_failed
from controlplane.problems import Problem

log = logging.getLogger("palisade.http")
access_log = logging.getLogger("palisade.access")

HEADER_CHECK_THREADS = 2  # a check is one primary-key read and a signature check: well under 1 ms
PASSED_SECONDS = 300.0  # an agent reports every minute: four in five reports pass without the database
PASSED_MAX = 100_000
RETRY_AFTER_SECONDS = 1
LOGIN_PATHS = frozenset({"/api/v1/session", "/login"})
LOGIN = "login"  # the budget of login bodies on the operator listener
LOGIN_BODY_BYTES = 16 * 1024  # a password, as JSON or a form
LOGIN_BUDGET_BYTES = 1024 * 1024
LINGER_SECONDS = 2.0
TIDY_SECONDS = 10.0

HeadersCheck = Callable[[Mapping[str, str]], object]


class BodyBudget:
    """Bytes of request bodies admitted on one listener and not yet answered (the reactor's thread
    only). A body is admitted when it fits, or when nothing else is in flight: a budget smaller than
    the largest body still admits that body, alone."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.in_flight = 0

    def take(self, size: int) -> bool:
        if self.in_flight and self.in_flight + size > self.capacity:
            return False
        self.in_flight += size
        return True

    def give_back(self, size: int) -> None:
        self.in_flight -= size


class _Claim:
    """What one request's body holds of its listener's budget; given back once, when it is answered."""

    def __init__(self, budget: BodyBudget, limit: int):
        self.budget, self.limit, self.size = budget, limit, 0

    def take(self, size: int) -> bool:
        if not self.budget.take(size):
            return False
        self.size += size
        return True

    def give_back(self, _result: object = None) -> None:
        self.budget.give_back(self.size)
        self.size = 0


_budgets: dict[str, BodyBudget] = {}
_check_thread = threading.local()
_checks: ThreadPoolExecutor | None = None


def budget_of(listener: str) -> BodyBudget:
    if not _budgets:
        _budgets[GATEWAY] = BodyBudget(settings.PALISADE_GATEWAY_BODY_BUDGET_BYTES)
        _budgets[OPERATOR] = BodyBudget(settings.PALISADE_OPERATOR_BODY_BUDGET_BYTES)
        _budgets[LOGIN] = BodyBudget(LOGIN_BUDGET_BYTES)
    return _budgets[listener]


@functools.lru_cache(maxsize=64)
def view_for(listener: str, path: str):
    """The view class `path` reaches on `listener` if it may have a `headers_check` (gateway views)."""
    if listener != GATEWAY:
        return None
    try:
        match = resolve(path, urlconf=settings.GATEWAY_URLCONF)
    except Resolver404:
        return None
    return getattr(match.func, "view_class", None)


class PassedHeaders:
    """Headers a check passed lately, by a digest of (path, the view's `headers_check_key`); the
    reactor's thread only."""

    def __init__(self, *, seconds: float = PASSED_SECONDS, most: int = PASSED_MAX):
        self.seconds, self.most = seconds, most
        self.until: dict[bytes, float] = {}

    @staticmethod
    def key(path: str, view, headers: Mapping[str, str]) -> bytes | None:
        key_of = getattr(view, "headers_check_key", None)
        if key_of is None:
            return None
        return hashlib.blake2b(repr((path, key_of(headers))).encode(), digest_size=16).digest()

    def passed(self, key: bytes | None) -> bool:
        return key is not None and self.until.get(key, 0.0) > time.monotonic()

    def remember(self, key: bytes | None) -> None:
        if key is None:
            return
        if len(self.until) >= self.most:
            now = time.monotonic()
            self.until = {k: t for k, t in self.until.items() if t > now}
            if len(self.until) >= self.most:
                self.until.clear()
        self.until[key] = time.monotonic() + self.seconds


passed_headers = PassedHeaders()


def headers_refusal(check: HeadersCheck, headers: Mapping[str, str]) -> Problem | None:
    """Run on a check thread: the Problem `check` raises, None when it passes. The database away is the
    503 with Retry-After that the view would answer, logged as the outage is (controlplane/outage.py).

    The thread keeps its database connection as Django keeps one between requests, but tidies it (its
    age, its health: a `SELECT 1` with CONN_HEALTH_CHECKS) once every TIDY_SECONDS and after a failure,
    not around every check: that round trip cost as much as the check's own query."""
    now = time.monotonic()
    if now - getattr(_check_thread, "tidied_at", -TIDY_SECONDS) >= TIDY_SECONDS:
        close_old_connections()
        _check_thread.tidied_at = now
    try:
        check(headers)
    except Problem as problem:
        return problem
    except Exception as error:  # noqa: BLE001 - refused, never let through unchecked
        _check_thread.tidied_at = -TIDY_SECONDS  # look at the connection before the next check
        if database_failed("check requests' headers", error, log):
            return service_unavailable(error)  # the database away or busy: one throttled line
        log.exception("checking a request's headers failed")
        return Problem("internal")
    return None


def _run_check(check: HeadersCheck, headers: Mapping[str, str]) -> Future:
    global _checks
    if _checks is None:
        _checks = ThreadPoolExecutor(HEADER_CHECK_THREADS, thread_name_prefix="http-headers")
    return _checks.submit(headers_refusal, check, headers)


def _request_path(raw: bytes) -> str:
    """The path as daphne gives it to the application (and so as Django routes it)."""
    try:
        return unquote(raw.split(b"?", 1)[0].decode("ascii"))
    except UnicodeDecodeError:
        return ""  # daphne refuses it (400); its body is held to the default limit meanwhile


def _busy(listener: str) -> Problem:
    what = (
        "the operator listener is receiving as many logins"
        if listener == LOGIN
        else (f"the {listener} listener is receiving as many request bodies")
    )
    return Problem(
        "service-unavailable",
        f"{what[:1].upper()}{what[1:]} as it holds at once; retry in {RETRY_AFTER_SECONDS} s.",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        retry_after=RETRY_AFTER_SECONDS,
    )


def _too_large(limit: int) -> Problem:
    return Problem("payload-too-large", f"The body exceeds {limit} bytes.", max_bytes=limit)


class BodyGate:
    """For twisted.web.http.HTTPChannel: admits each request's body, or refuses it unread. The channel
    provides `refuse(problem, instance=path)`, which writes the problem document and closes the connection."""

    _gate_refused = False  # a refusal was sent: what arrives is discarded
    _gate_lost = False
    _gate_linger = None
    _gate_continue = False  # answer `Expect: 100-continue` once the body is admitted
    _gate_checking = False  # a headers check runs: nothing of the body is read meanwhile
    _gate_path = ""

    def allHeadersReceived(self):
        request = self.requests[-1]
        # Twisted answers 100-continue here; a body that may be refused is not asked for yet.
        expect = request.requestHeaders.getRawHeaders(b"Expect")
        if expect:
            request.requestHeaders.removeHeader(b"Expect")
        super().allHeadersReceived()
        if expect:
            request.requestHeaders.setRawHeaders(b"Expect", expect)
        self._gate_continue = (
            bool(expect) and expect[0].lower() == b"100-continue" and self._version == b"HTTP/1.1"
        )
        if self.length == 0:
            return
        listener = listener_for_port(self.transport.getHost().port)
        path = self._gate_path = _request_path(self._path)
        limit = body_limit(path)
        login = listener == OPERATOR and path in LOGIN_PATHS
        if login:
            limit, listener = min(limit, LOGIN_BODY_BYTES), LOGIN
        if self.length is not None and self.length > limit:
            self._gate_refuse(_too_large(limit))
            return
        view = view_for(listener, path)
        check = operator_credential_check if listener == OPERATOR else getattr(view, "headers_check", None)
        if check is None:
            self._gate_admit(request, listener, limit)
            return
        headers = CaseInsensitiveMapping(
            {
                name.decode("latin-1"): values[0].decode("latin-1")
                for name, values in request.requestHeaders.getAllRawHeaders()
            }
        )
        key = PassedHeaders.key(path, view, headers)
        if passed_headers.passed(key):
            self._gate_admit(request, listener, limit)
            return
        # Twisted's own state while a request is handled: data is buffered, and reading pauses past
        # 16 KiB. Reading pauses now, so a body that is refused is never received.
        self._handlingRequest = True
        self._networkProducer.pauseProducing()
        self._gate_checking = True
        from twisted.internet import reactor

        _run_check(check, headers).add_done_callback(
            lambda done: reactor.callFromThread(
                self._gate_checked, request, listener, limit, key, done.result()
            )
        )

    def _gate_checked(self, request, listener: str, limit: int, key, refusal: Problem | None) -> None:
        self._gate_checking = False
        if refusal is None:
            passed_headers.remember(key)
        if self._gate_lost:
            return
        self._handlingRequest = False
        if refusal is not None:
            self._gate_refuse(refusal)
            return
        if not self._gate_admit(request, listener, limit):
            return
        held, self._dataBuffer = b"".join(self._dataBuffer), []
        if held:
            self.rawDataReceived(held)
        if not self._gate_refused:
            self._networkProducer.resumeProducing()

    def _gate_admit(self, request, listener: str, limit: int) -> bool:
        claim = _Claim(budget_of(listener), limit)
        if self.length is not None and not claim.take(self.length):
            self._gate_refuse(_busy(listener))
            return False
        request.notifyFinish().addBoth(claim.give_back)  # answered, or the connection lost
        if self.length is None:  # chunked: each decoded piece takes its bytes as it arrives
            decoder = self._transferDecoder
            decoder.dataCallback = self._gate_counted(claim, listener, decoder.dataCallback)
            decoder.finishCallback = self._gate_unless_refused(decoder.finishCallback)
        if self._gate_continue:
            self._gate_continue = False
            self._send100Continue()
        return True

    def _gate_counted(self, claim: _Claim, listener: str, received: Callable[[bytes], None]):
        def counted(data: bytes) -> None:
            if self._gate_refused:
                return
            if claim.size + len(data) > claim.limit:
                self._gate_refuse(_too_large(claim.limit))
            elif not claim.take(len(data)):
                self._gate_refuse(_busy(listener))
            else:
                received(data)

        return counted

    def _gate_unless_refused(self, finished: Callable[[bytes], None]):
        def finish(extra: bytes) -> None:
            if not self._gate_refused:
                finished(extra)

        return finish

    def _gate_refuse(self, problem: Problem) -> None:
        self._gate_refused = True
        self._dataBuffer = []
        peer = self.transport.getPeer()
        access_log.info(  # as the access log's lines for requests Django answers
            "%s %s %s before its body %s %s",
            self._command.decode("latin-1"),
            self._gate_path or "-",
            problem.status,
            listener_for_port(self.transport.getHost().port),
            getattr(peer, "host", "-"),
        )
        self.transport.resumeProducing()  # to read the client's close, discarding its body meanwhile
        self.refuse(problem, instance=self._gate_path or None)
        from twisted.internet import reactor

        self._gate_linger = reactor.callLater(LINGER_SECONDS, self.transport.abortConnection)

    def rawDataReceived(self, data: bytes) -> None:
        if self._gate_refused:
            return
        super().rawDataReceived(data)

    def connectionLost(self, reason):
        self._gate_lost = True
        if self._gate_linger is not None and self._gate_linger.active():
            self._gate_linger.cancel()
        super().connectionLost(reason)

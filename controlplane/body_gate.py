"""Request bodies, decided on when a request's headers are in and before serve receives its body.

daphne hands a request to the application only once Twisted has received the whole body (into a
temporary file from 1 MiB on), and the HTTP entry then holds it in memory for Django. Anything that
should refuse a body without reading it must therefore run here, on the HTTP channel:

- a body over its path's limit is 413 `payload-too-large` at once: a Content-Length over it, or a
  chunked body as soon as it streams past it;
- on the gateway listener, a view's `headers_check` (flow reports: an enrolled workload presenting its
  current, unexpired, unrevoked credential; flows/gateway.py) runs on a thread of its own while the
  channel reads nothing more of the body; a refusal is the problem document the view would give. Headers
  the check passed (by the view's `headers_check_key`) pass again for PASSED_SECONDS without it, but only
  while this process hears of every credential change (controlplane/credential_watch.py, on PostgreSQL;
  on SQLite every report's headers are checked): a revocation, renewal or re-enrolment made anywhere
  forgets the workload's passes before its next report. serve's answer to the report takes what the
  check returned from a pass that holds (`PassedHeaders.passed_value`: the sender, without a second
  read; controlplane/gateway_reports.py), and the report's write judges the sender's credential again
  under its workload's lock;
- on the operator listener, every body but a login's needs a credential first (an operator token or a
  live session cookie; controlplane/auth/authentication.py's `operator_credential_check`, run the same
  way): whoever holds none is refused 401 unread, so cannot hold the budget that operators' writes need.
  A login's body (`POST /api/v1/session`, the console's `/login`) is at most LOGIN_BODY_BYTES, from a
  budget of its own (LOGIN_BUDGET_BYTES): a flood of them can delay logins, not writes. Likewise, a body
  on the gateway listener that is not a flow report (an enrolment: no credential to check before it) is
  at most OTHER_BODY_BYTES, from a budget of its own (OTHER_BUDGET_BYTES), not the reports';
- the bytes of bodies in flight, from when a body is admitted until its request is answered, are bounded
  per listener (`PALISADE_GATEWAY_BODY_BUDGET_BYTES`, `PALISADE_OPERATOR_BODY_BUDGET_BYTES`): a body the
  budget has no room for is 503 `service-unavailable` with Retry-After. A body of unknown length takes
  its bytes as they arrive.

The gateway's budget (64 MiB by default) is shared fairly, so that no enrolled workload, nor a few, can
keep the others' reports out:

- one body in flight per workload (the view's `body_owner`, known once the headers passed): another
  report of the same workload meanwhile is 429 `rate-limited` with Retry-After (RETRY_AFTER_SECONDS),
  before its body. An agent sends one report at a time. (Per serve process: each has its own budget.)
- room kept for small reports: a body over SMALL_BODY_BYTES (1 MiB; a chunked body once it passes it)
  is admitted only while the bodies in flight leave a quarter of the budget free (1 / RESERVE_SHARE:
  16 MiB), which only bodies up to 1 MiB may take. A minute's report is a few KB to a few hundred.
- a deadline proportional to the length: every body on the gateway listener, once admitted, keeps a pace
  of `PALISADE_GATEWAY_BODY_MIN_RATE` bytes a second (16 KiB/s) after a grace of 10 s, or its connection
  is closed (controlplane/connection_limits.py). A body admitted at t0 has received at least
  rate * (t - t0 - 10 s) bytes at every t after the grace, so one of declared length L is complete by
  t0 + 10 s + L / rate (32 MiB: 34 min; the agent's 8 MiB: 9 min; 1 MiB: 74 s), and one of unknown
  length (chunked) is held to the same pace on what it has sent: complete by t0 + 10 s + limit / rate
  at the latest.

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
from controlplane.credential_watch import CredentialWatch
from controlplane.listeners import GATEWAY, OPERATOR, body_limit, listener_for_port
from controlplane.outage import database_failed
from controlplane.problems import Problem
from controlplane.reactor_calls import reactor_call

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
OTHER = "gateway-other"  # the budget of the gateway's bodies that are not flow reports (enrolments)
OTHER_BODY_BYTES = 64 * 1024  # an enrolment is under 4 KB (at most 64 addresses)
OTHER_BUDGET_BYTES = 4 * 1024 * 1024
SMALL_BODY_BYTES = 1024 * 1024  # a flow report this small may take the room kept for small ones
RESERVE_SHARE = 4  # a quarter of the gateway's budget is kept for small bodies
LINGER_SECONDS = 2.0
TIDY_SECONDS = 10.0

HeadersCheck = Callable[[Mapping[str, str]], object]


class BodyBudget:
    """Bytes of request bodies admitted on one listener and not yet answered, and the owners (workloads)
    holding one (the reactor's thread only). A body is admitted when it fits, or when nothing else is in
    flight: a budget smaller than the largest body still admits that body alone. A body over `small`
    bytes fits only while `reserve` bytes stay free, for the small ones."""

    def __init__(self, capacity: int, *, reserve: int = 0, small: int = 0):
        self.capacity, self.reserve, self.small = capacity, reserve, small
        self.in_flight = 0
        self.owners: set[str] = set()

    def take(self, size: int, *, body: int | None = None) -> bool:
        """`size` bytes more, of a body that then holds `body` bytes in all (`size` by default)."""
        small = (size if body is None else body) <= self.small
        room = self.capacity if small else self.capacity - self.reserve
        if self.in_flight and self.in_flight + size > room:
            return False
        self.in_flight += size
        return True

    def give_back(self, size: int) -> None:
        self.in_flight -= size


class _Claim:
    """What one request's body holds of its budget: bytes, and its owner's one body in flight. Given
    back once, when the request is answered or its connection is lost."""

    def __init__(self, budget: BodyBudget, limit: int, owner: str | None):
        self.budget, self.limit, self.owner, self.size = budget, limit, owner, 0

    def take(self, size: int) -> bool:
        if not self.budget.take(size, body=self.size + size):
            return False
        self.size += size
        return True

    def give_back(self, _result: object = None) -> None:
        self.budget.give_back(self.size)
        self.size = 0
        if self.owner is not None:
            self.budget.owners.discard(self.owner)
            self.owner = None


_budgets: dict[str, BodyBudget] = {}
_check_thread = threading.local()
_checks: ThreadPoolExecutor | None = None


def budget_of(name: str) -> BodyBudget:
    if not _budgets:
        gateway = settings.PALISADE_GATEWAY_BODY_BUDGET_BYTES
        _budgets[GATEWAY] = BodyBudget(gateway, reserve=gateway // RESERVE_SHARE, small=SMALL_BODY_BYTES)
        _budgets[OTHER] = BodyBudget(OTHER_BUDGET_BYTES)
        _budgets[OPERATOR] = BodyBudget(settings.PALISADE_OPERATOR_BODY_BUDGET_BYTES)
        _budgets[LOGIN] = BodyBudget(LOGIN_BUDGET_BYTES)
    return _budgets[name]


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


def _route(listener: str, path: str) -> tuple[str, int, object, HeadersCheck | None]:
    """(the budget a body to `path` takes, its limit, the view, the check of its headers)."""
    limit = body_limit(path)
    if listener == OPERATOR:
        if path in LOGIN_PATHS:
            return LOGIN, min(limit, LOGIN_BODY_BYTES), None, None
        return OPERATOR, limit, None, operator_credential_check
    view = view_for(GATEWAY, path)
    check = getattr(view, "headers_check", None)
    if check is None:
        return OTHER, min(limit, OTHER_BODY_BYTES), view, None
    return GATEWAY, limit, view, check


class PassedHeaders:
    """Headers a check passed lately, by a digest of (path, the view's `headers_check_key`), with their
    owner (the view's `body_owner`); the reactor's thread only. They pass again only while `trusted()`
    (this process hears of every credential change), and an owner's are forgotten when its credential
    changes. `generation` moves at each forgetting: a check running meanwhile may have read the database
    before the change, and what it passed is not remembered."""

    def __init__(
        self,
        *,
        seconds: float = PASSED_SECONDS,
        most: int = PASSED_MAX,
        trusted: Callable[[], bool] = lambda: True,
    ):
        self.seconds, self.most, self.trusted = seconds, most, trusted
        self.until: dict[bytes, tuple[float, str | None, object]] = {}
        self.keys_of: dict[str, set[bytes]] = {}  # by owner: a renewal forgets a few keys, not a scan
        self.generation = 0

    @staticmethod
    def key(path: str, view, headers: Mapping[str, str]) -> bytes | None:
        key_of = getattr(view, "headers_check_key", None)
        if key_of is None:
            return None
        return hashlib.blake2b(repr((path, key_of(headers))).encode(), digest_size=16).digest()

    def passed(self, key: bytes | None) -> bool:
        entry = self.until.get(key) if key is not None else None
        return entry is not None and entry[0] > time.monotonic() and self.trusted()

    def passed_value(self, key: bytes | None) -> object:
        """What the check returned when it passed these headers, while they pass again (None otherwise).
        Read by the view's thread too: one dict read, and the trust read as `passed` reads it."""
        entry = self.until.get(key) if key is not None else None
        return entry[2] if entry is not None and entry[0] > time.monotonic() and self.trusted() else None

    def remember(
        self,
        key: bytes | None,
        owner: str | None = None,
        *,
        generation: int | None = None,
        value: object = None,
    ) -> None:
        if key is None or generation not in (None, self.generation) or not self.trusted():
            return
        if len(self.until) >= self.most:
            now = time.monotonic()
            self.until = {k: entry for k, entry in self.until.items() if entry[0] > now}
            if len(self.until) >= self.most:
                self.until.clear()
            self.keys_of = {}
            for k, (_, held_by, _) in self.until.items():
                if held_by is not None:
                    self.keys_of.setdefault(held_by, set()).add(k)
        self.until[key] = (time.monotonic() + self.seconds, owner, value)
        if owner is not None:
            self.keys_of.setdefault(owner, set()).add(key)

    def forget(self, owner: str) -> None:
        """The owner's credential changed: revoked, renewed or re-enrolled."""
        self.generation += 1
        for key in self.keys_of.pop(owner, ()):
            self.until.pop(key, None)

    def forget_all(self) -> None:
        self.generation += 1
        self.until.clear()
        self.keys_of.clear()


passed_headers = PassedHeaders()
credential_watch = CredentialWatch(changed=passed_headers.forget, reset=passed_headers.forget_all)
passed_headers.trusted = credential_watch.live


def headers_refusal(check: HeadersCheck, headers: Mapping[str, str]) -> tuple[Problem | None, object]:
    """Run on a check thread: the Problem `check` raises, or None and what it returned when it passes.
    The database away is the 503 with Retry-After that the view would answer, logged as the outage is
    (controlplane/outage.py).

    The thread keeps its database connection as Django keeps one between requests, but tidies it (its
    age, its health: a `SELECT 1` with CONN_HEALTH_CHECKS) once every TIDY_SECONDS and after a failure,
    not around every check: that round trip cost as much as the check's own query."""
    now = time.monotonic()
    if now - getattr(_check_thread, "tidied_at", -TIDY_SECONDS) >= TIDY_SECONDS:
        close_old_connections()
        _check_thread.tidied_at = now
    try:
        return None, check(headers)
    except Problem as problem:
        return problem, None
    except Exception as error:  # noqa: BLE001 - refused, never let through unchecked
        _check_thread.tidied_at = -TIDY_SECONDS  # look at the connection before the next check
        if database_failed("check requests' headers", error, log):
            return service_unavailable(error), None  # the database away or busy: one throttled line
        log.exception("checking a request's headers failed")
        return Problem("internal"), None


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


_BUSY = {
    LOGIN: "The operator listener is receiving as many logins",
    OPERATOR: "The operator listener is receiving as many request bodies",
    GATEWAY: "The gateway listener is receiving as many request bodies",
    OTHER: "The gateway listener is receiving as many enrolment bodies",
}


def _busy(budget: str, *, small: bool = True) -> Problem:
    what = _BUSY[budget]
    if not small and budget_of(budget).reserve:
        what += (
            f" over {SMALL_BODY_BYTES // (1024 * 1024)} MiB (a quarter of its room is kept for smaller ones)"
        )
    return Problem(
        "service-unavailable",
        f"{what} as it holds at once; retry in {RETRY_AFTER_SECONDS} s.",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        retry_after=RETRY_AFTER_SECONDS,
    )


def _one_at_a_time(owner: str) -> Problem:
    return Problem(
        "rate-limited",
        f"Workload {owner} already has a flow report on its way to this gateway: it sends one at a "
        f"time; retry in {RETRY_AFTER_SECONDS} s.",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        retry_after=RETRY_AFTER_SECONDS,
    )


def _too_large(limit: int) -> Problem:
    return Problem("payload-too-large", f"The body exceeds {limit} bytes.", max_bytes=limit)


class BodyGate:
    """For twisted.web.http.HTTPChannel: admits each request's body, or refuses it unread. The channel
    provides `refuse(problem, instance=path)`, which writes the problem document and closes the
    connection, and `_limits`, its connection's limits (controlplane/connection_limits.py) or None."""

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
        path = self._gate_path = _request_path(self._path)
        budget, limit, view, check = _route(listener_for_port(self.transport.getHost().port), path)
        if self.length is not None and self.length > limit:
            self._gate_refuse(_too_large(limit))
            return
        if check is None:
            self._gate_admit(request, budget, limit, None)
            return
        headers = CaseInsensitiveMapping(
            {
                name.decode("latin-1"): values[0].decode("latin-1")
                for name, values in request.requestHeaders.getAllRawHeaders()
            }
        )
        key = PassedHeaders.key(path, view, headers)
        owner_of = getattr(view, "body_owner", None)
        owner = owner_of(headers) if owner_of is not None else None
        if passed_headers.passed(key):
            self._gate_admit(request, budget, limit, owner)
            return
        # Twisted's own state while a request is handled: data is buffered, and reading pauses past
        # 16 KiB. Reading pauses now, so a body that is refused is never received.
        self._handlingRequest = True
        self._networkProducer.pauseProducing()
        self._gate_checking = True
        generation = passed_headers.generation
        _run_check(check, headers).add_done_callback(
            lambda done: reactor_call(
                self._gate_checked, request, budget, limit, (key, owner, generation), *done.result()
            )
        )

    def _gate_checked(
        self, request, budget: str, limit: int, passed, refusal: Problem | None, value: object = None
    ) -> None:
        key, owner, generation = passed
        self._gate_checking = False
        if refusal is None:
            passed_headers.remember(key, owner, generation=generation, value=value)
        if self._gate_lost:
            return
        self._handlingRequest = False
        if refusal is not None:
            self._gate_refuse(refusal)
            return
        if not self._gate_admit(request, budget, limit, owner):
            return
        held, self._dataBuffer = b"".join(self._dataBuffer), []
        if held:
            self.rawDataReceived(held)
        if not self._gate_refused:
            self._networkProducer.resumeProducing()

    def _gate_admit(self, request, name: str, limit: int, owner: str | None) -> bool:
        budget = budget_of(name)
        if owner is not None and owner in budget.owners:
            self._gate_refuse(_one_at_a_time(owner))
            return False
        claim = _Claim(budget, limit, None)
        if self.length is not None and not claim.take(self.length):
            self._gate_refuse(_busy(name, small=self.length <= budget.small))
            return False
        if owner is not None:
            budget.owners.add(owner)
            claim.owner = owner
        request.notifyFinish().addBoth(claim.give_back)  # answered, or the connection lost
        if self.length is None:  # chunked: each decoded piece takes its bytes as it arrives
            decoder = self._transferDecoder
            decoder.dataCallback = self._gate_counted(claim, name, decoder.dataCallback)
            decoder.finishCallback = self._gate_unless_refused(decoder.finishCallback)
        limits = getattr(self, "_limits", None)
        if limits is not None:  # the body's clock starts now, at the gateway's pace there
            limits.body_admitted(settings.PALISADE_GATEWAY_BODY_MIN_RATE if name in (GATEWAY, OTHER) else 0)
        if self._gate_continue:
            self._gate_continue = False
            self._send100Continue()
        return True

    def _gate_counted(self, claim: _Claim, name: str, received: Callable[[bytes], None]):
        def counted(data: bytes) -> None:
            if self._gate_refused:
                return
            if claim.size + len(data) > claim.limit:
                self._gate_refuse(_too_large(claim.limit))
            elif not claim.take(len(data)):
                self._gate_refuse(_busy(name, small=claim.size + len(data) <= claim.budget.small))
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

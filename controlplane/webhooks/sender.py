"""The sender: delivers the outbox's pending deliveries, signed the Standard Webhooks way.

- Each webhook is delivered by rounds of its own (`webhook_round`): serve's housekeeping step
  (`webhook_rounds_start`) queues a round for every webhook with due deliveries on a few sender
  threads and never waits for one, so a slow, hanging or dead receiver delays only its own
  deliveries. A round makes attempts one at a time until none is due, one fails, or its time budget
  (`PALISADE_WEBHOOK_ROUND_SECONDS`) is spent; the webhook's next round queues behind the others.
- One delivery per (webhook, workload) is in flight at a time, the oldest pending one: the next event
  of a workload is not sent before the previous one was delivered or given up (order per workload).
- On PostgreSQL a delivery is claimed with `SELECT ... FOR UPDATE SKIP LOCKED` and its row stays
  locked while it is sent, so several serve processes each send different deliveries and an event
  reaches a webhook once (at least once: a process killed after the receiver answered and before its
  commit sends it again). SQLite has no row locks and one writer at a time: the attempt is made
  outside any transaction, and one serve process per database runs one round per webhook at a time.
- A failed attempt (no answer, not a 2xx, a redirect: redirects are never followed) is retried after a
  delay drawn uniformly from [0, min(cap, base * 2^(attempts-1))] (exponential backoff, full jitter);
  the first failure past the give-up period (24 h) gives the delivery up, and with it every other
  pending delivery to that webhook past the period too (closed in bulk, the reason recorded).
- Each attempt is bounded: `PALISADE_WEBHOOK_TIMEOUT_SECONDS` for the name lookup, connecting, sending
  and the answer together. Only the destination checked (controlplane/webhooks/destinations.py) is
  connected to. An attempt records the status code and a short reason of ours, never the receiver's
  text: at most `ANSWER_READ_BYTES` of its body are read, and dropped.
- Pending deliveries per webhook over `PALISADE_WEBHOOK_MAX_PENDING` are given up, the oldest first,
  the reason recorded (`webhook_backlogs_cap`, a housekeeping step).
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import DatabaseError, connection, connections, transaction
from django.db.models import Count, Exists, OuterRef, QuerySet
from standardwebhooks.webhooks import Webhook as Signer

from controlplane import clock
from controlplane.outage import database_failed
from controlplane.text import visible
from controlplane.webhooks.destinations import (
    Destination,
    Refused,
    destination_of,
    host_check,
    resolve,
    resolved_check,
)
from controlplane.webhooks.models import Webhook, WebhookAttempt, WebhookDelivery, WebhookEvent

log = logging.getLogger("palisade.webhooks")

ANSWER_READ_BYTES = 1024  # read, so that a receiver still writing is not cut off, and dropped
MAX_ERROR_CHARS = 500
USER_AGENT = "Palisade-Webhooks/1"
CLOSE_BATCH = 1000  # deliveries given up unsent per statement


def retry_delay(attempts: int, *, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Seconds before the next attempt after `attempts` failed ones: full jitter over an exponential."""
    ceiling = min(cap, base * 2 ** min(attempts - 1, 62))
    return (rng or random).uniform(0, ceiling)


@dataclass(frozen=True)
class Answer:
    status_code: int | None
    error: str
    duration_ms: int

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def payload(event: WebhookEvent, delivery: WebhookDelivery | None = None) -> str:
    """The body: the Standard Webhooks shape (type, timestamp, data), plus the event id; a delivery
    standing for several events of its workload and type says how many, and since when."""
    data = dict(event.data)
    if delivery is not None and delivery.coalesced_count > 1:
        data["coalesced"] = {
            "count": delivery.coalesced_count,
            "since": clock.rfc3339(delivery.coalesced_since or event.occurred_at),
        }
    return json.dumps(
        {"id": event.id, "type": event.type, "timestamp": clock.rfc3339(event.occurred_at), "data": data},
        separators=(",", ":"),
        sort_keys=True,
    )


def signed_headers(*, secret: str, event_id: str, body: str, at: datetime) -> dict[str, str]:
    return {
        "webhook-id": event_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": Signer(secret).sign(msg_id=event_id, timestamp=at, data=body),
    }


def _tls_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    if settings.PALISADE_WEBHOOK_CA_FILE:
        context.load_verify_locations(cafile=settings.PALISADE_WEBHOOK_CA_FILE)
    return context


def _connected(destination: Destination, deadline: float) -> socket.socket:
    """A TCP connection, made before `deadline` (monotonic), to an address the destination's host
    resolves to, once every address it resolves to passed the checks (`Refused` otherwise)."""
    resolved = resolve(destination, deadline=deadline)
    resolved_check(destination, resolved)
    failure: OSError = OSError(f"no address for {destination.host}")
    for family, kind, protocol, _, address in resolved:
        sock = socket.socket(family, kind, protocol)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect(address)
            return sock
        except OSError as error:
            sock.close()
            failure = error
    raise failure


def status_reason(status: int) -> str:
    if 200 <= status < 300:
        return ""
    return "redirect not followed" if 300 <= status < 400 else f"HTTP {status}"


def failure_reason(failure: BaseException) -> str:
    """What went wrong, in our words: the receiver's bytes (a banner read as a status line, say) are
    never part of it."""
    if isinstance(failure, Refused):
        return f"refused: {failure.reason}"
    if isinstance(failure, ssl.SSLCertVerificationError):
        return f"TLS: certificate not trusted ({failure.verify_message})"
    if isinstance(failure, ssl.SSLError):
        return "TLS handshake failed"
    if isinstance(failure, http.client.RemoteDisconnected):
        return "closed the connection without an answer"
    if isinstance(failure, http.client.HTTPException):
        return "not an HTTP answer"
    if isinstance(failure, socket.gaierror | UnicodeError):
        return "the host name does not resolve"
    if isinstance(failure, OSError) and failure.strerror:
        return f"{type(failure).__name__}: {failure.strerror}"
    return type(failure).__name__


def http_post(url: str, *, body: bytes, headers: dict[str, str], timeout: float) -> Answer:
    """One bounded POST. http.client never follows a redirect; a 3xx is reported as the failure it is.
    The name lookup and the connection share the deadline, and a watchdog shuts the socket down at
    it, so a receiver that answers a byte at a time cannot hold the sender past it either."""
    started = time.monotonic()
    deadline = started + timeout
    try:
        destination = destination_of(url)
        host_check(destination)
    except Refused as refused:
        return Answer(None, failure_reason(refused)[:MAX_ERROR_CHARS], 0)
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    # The connection is made below (bounded); the class only gives the Host header its default port.
    conn = (http.client.HTTPSConnection if destination.secure else http.client.HTTPConnection)(
        destination.host, destination.port, timeout=timeout
    )

    def cut() -> None:
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(timeout, cut)
    watchdog.daemon = True
    watchdog.start()
    status: int | None = None
    error = ""
    try:
        conn.sock = sock = _connected(destination, deadline)  # the watchdog can cut the handshake too
        if destination.secure:
            conn.sock = _tls_context().wrap_socket(sock, server_hostname=destination.host)
        conn.request(
            "POST",
            path,
            body=body,
            headers={**headers, "Content-Type": "application/json", "User-Agent": USER_AGENT},
        )
        response = conn.getresponse()
        status = response.status
        error = status_reason(status)
        response.read(ANSWER_READ_BYTES)
    except (OSError, UnicodeError, http.client.HTTPException, Refused) as failure:
        if status is not None:
            pass  # the status line and headers came: the body's trouble changes nothing
        elif time.monotonic() - started >= timeout:
            error = f"no answer within {timeout:g} s"
        else:
            error = failure_reason(failure)
    finally:
        watchdog.cancel()
        conn.close()
    duration_ms = int((time.monotonic() - started) * 1000)
    return Answer(status, visible(error)[:MAX_ERROR_CHARS], duration_ms)


# --- claiming, attempting, recording ----------------------------------------------------------------


def _locks_rows() -> bool:
    return bool(connection.features.has_select_for_update_skip_locked)


def _skip_locked(rows: QuerySet) -> QuerySet:
    return rows.select_for_update(skip_locked=True, of=("self",)) if _locks_rows() else rows


def _first_due(webhook_id: Any, now: datetime) -> WebhookDelivery | None:
    """The webhook's oldest due delivery whose workload has no earlier one pending (locked, or not)."""
    earlier = WebhookDelivery.objects.filter(
        webhook_id=OuterRef("webhook_id"),
        order_key=OuterRef("order_key"),
        state=WebhookDelivery.PENDING,
        event_seq__lt=OuterRef("event_seq"),
    )
    due = (
        WebhookDelivery.objects.filter(
            webhook_id=webhook_id, state=WebhookDelivery.PENDING, next_attempt_at__lte=now
        )
        .exclude(Exists(earlier))
        .order_by("event_seq", "id")
    )
    return _skip_locked(due).first()


Post = Callable[..., Answer]


def _attempt_one(webhook_id: Any, post: Post) -> Answer | None:
    """Claim, send and record the webhook's first due delivery; None when none is due. On PostgreSQL
    the claim's row lock is held while sending; on SQLite the attempt is made between two short
    transactions (its write lock is the whole database's)."""
    if _locks_rows():
        with transaction.atomic():
            claimed = _claimed(webhook_id)
            if claimed is None:
                return None
            at, answer = _send(*claimed, post)
            _record(*claimed, at=at, answer=answer)
            return answer
    claimed = _claimed(webhook_id)
    if claimed is None:
        return None
    at, answer = _send(*claimed, post)
    with transaction.atomic():
        _record(*claimed, at=at, answer=answer)
    return answer


def _claimed(webhook_id: Any) -> tuple[WebhookDelivery, Webhook, WebhookEvent] | None:
    delivery = _first_due(webhook_id, clock.now())
    if delivery is None:
        return None
    webhook = Webhook.objects.filter(id=webhook_id).first()  # None: deleted since
    if webhook is None:
        return None
    return delivery, webhook, WebhookEvent.objects.get(seq=delivery.event_id)


def _send(
    delivery: WebhookDelivery, webhook: Webhook, event: WebhookEvent, post: Post
) -> tuple[datetime, Answer]:
    at = clock.now()
    body = payload(event, delivery)
    headers = signed_headers(secret=webhook.secret, event_id=event.id, body=body, at=at.astimezone(UTC))
    answer = post(
        webhook.url, body=body.encode(), headers=headers, timeout=settings.PALISADE_WEBHOOK_TIMEOUT_SECONDS
    )
    return at, answer


def _record(
    delivery: WebhookDelivery, webhook: Webhook, event: WebhookEvent, *, at: datetime, answer: Answer
) -> None:
    now = clock.now()
    attempts = delivery.attempts + 1
    next_attempt_at = finished_at = None
    give_up = timedelta(seconds=settings.PALISADE_WEBHOOK_GIVE_UP_SECONDS)
    if answer.delivered:
        state, outcome, finished_at = WebhookDelivery.DELIVERED, WebhookAttempt.DELIVERED, now
    elif now - delivery.created_at >= give_up:
        state, outcome, finished_at = WebhookDelivery.GAVE_UP, WebhookAttempt.GAVE_UP, now
    else:
        delay = retry_delay(
            attempts,
            base=settings.PALISADE_WEBHOOK_RETRY_BASE_SECONDS,
            cap=settings.PALISADE_WEBHOOK_RETRY_CAP_SECONDS,
        )
        state, outcome = WebhookDelivery.PENDING, WebhookAttempt.RETRYING
        next_attempt_at = now + timedelta(seconds=delay)
    # Still pending unless closed meanwhile (SQLite: its webhook deleted, or given up over the cap):
    # then there is nothing left to record.
    updated = WebhookDelivery.objects.filter(id=delivery.id, state=WebhookDelivery.PENDING).update(
        attempts=attempts,
        state=state,
        finished_at=finished_at,
        next_attempt_at=next_attempt_at or delivery.next_attempt_at,
    )
    if not updated:
        return
    WebhookAttempt.objects.create(
        delivery_id=delivery.id,
        webhook_id=webhook.id,
        event_id=event.id,
        event_type=event.type,
        number=attempts,
        at=at,
        duration_ms=answer.duration_ms,
        status_code=answer.status_code,
        error=answer.error,
        outcome=outcome,
        next_attempt_at=next_attempt_at,
    )
    if outcome == WebhookAttempt.GAVE_UP:
        log.warning(
            "gave up delivering %s %s to webhook %s after %d attempts: %s",
            event.type,
            event.id,
            webhook.id,
            attempts,
            answer.error,
        )
        _give_up_unsent(
            _skip_locked(
                WebhookDelivery.objects.filter(
                    webhook_id=webhook.id, state=WebhookDelivery.PENDING, created_at__lte=now - give_up
                )
            ),
            webhook_id=webhook.id,
            reason=f"given up with the rest: the receiver failed past the give-up period ({answer.error})",
        )
    elif answer.status_code is None and next_attempt_at is not None:
        _hold_back(webhook, until=next_attempt_at)


def _hold_back(webhook: Webhook, *, until: datetime) -> None:
    """A receiver that did not answer at all (down, refusing, hanging) is not tried again for its
    other deliveries before this one's retry: otherwise each round would spend an attempt, and up to
    its whole timeout, on the next of them. A receiver that answers (even 5xx) keeps each delivery's
    own schedule. Rows another sender holds are left to it."""
    waiting = _skip_locked(
        WebhookDelivery.objects.filter(
            webhook_id=webhook.id, state=WebhookDelivery.PENDING, next_attempt_at__lt=until
        )
    )
    ids = list(waiting.values_list("id", flat=True))
    WebhookDelivery.objects.filter(id__in=ids).update(next_attempt_at=until)


def _give_up_unsent(deliveries: QuerySet, *, webhook_id: Any, reason: str) -> int:
    """Give up these pending deliveries without an attempt, each with an attempt record of number 0
    carrying the reason (what `GET /webhooks/{id}/deliveries` shows), in batches."""
    now = clock.now()
    rows = list(deliveries.values_list("id", "event__id", "event__type"))
    for start in range(0, len(rows), CLOSE_BATCH):
        batch = rows[start : start + CLOSE_BATCH]
        WebhookDelivery.objects.filter(id__in=[row[0] for row in batch]).update(
            state=WebhookDelivery.GAVE_UP, finished_at=now
        )
        WebhookAttempt.objects.bulk_create(
            WebhookAttempt(
                delivery_id=id,
                webhook_id=webhook_id,
                event_id=event_id,
                event_type=event_type,
                number=0,
                at=now,
                duration_ms=0,
                status_code=None,
                error=reason[:MAX_ERROR_CHARS],
                outcome=WebhookAttempt.GAVE_UP,
            )
            for id, event_id, event_type in batch
        )
    if rows:
        log.warning("gave up %d pending deliveries to webhook %s unsent: %s", len(rows), webhook_id, reason)
    return len(rows)


def webhook_backlogs_cap(*, limit: int | None = None) -> int:
    """Give up, unsent and oldest first, the pending deliveries of each webhook beyond `limit`
    (`PALISADE_WEBHOOK_MAX_PENDING`); returns how many. Rows a sender holds are left to it."""
    limit = settings.PALISADE_WEBHOOK_MAX_PENDING if limit is None else limit
    over = (
        WebhookDelivery.objects.filter(state=WebhookDelivery.PENDING)
        .values("webhook_id")
        .annotate(pending=Count("id"))
        .filter(pending__gt=limit)
        .values_list("webhook_id", "pending")
    )
    closed = 0
    for webhook_id, pending in list(over):
        with transaction.atomic():
            pending_ones = WebhookDelivery.objects.filter(
                webhook_id=webhook_id, state=WebhookDelivery.PENDING
            )
            oldest = _skip_locked(pending_ones.order_by("event_seq", "id")).values_list("id", flat=True)
            closed += _give_up_unsent(
                WebhookDelivery.objects.filter(id__in=list(oldest[: pending - limit])),
                webhook_id=webhook_id,
                reason=f"given up unsent: over {limit} pending deliveries to this webhook, the oldest go",
            )
    return closed


# --- rounds -----------------------------------------------------------------------------------------


def webhook_round(*, webhook_id: Any, post: Post = http_post, budget_seconds: float | None = None) -> int:
    """One round of one webhook: attempts one at a time, oldest first (one per workload at a time),
    until none is due, one fails (a failing receiver costs one attempt per round), or the budget is
    spent (no attempt starts after it). Returns the attempts made."""
    budget = settings.PALISADE_WEBHOOK_ROUND_SECONDS if budget_seconds is None else budget_seconds
    deadline = time.monotonic() + budget
    attempted = 0
    while time.monotonic() < deadline:
        answer = _attempt_one(webhook_id, post)
        if answer is None:
            break
        attempted += 1
        if not answer.delivered:
            break
    return attempted


def webhooks_due(*, now: datetime | None = None) -> list[Any]:
    """The webhooks with at least one delivery due."""
    due = WebhookDelivery.objects.filter(
        state=WebhookDelivery.PENDING, next_attempt_at__lte=now or clock.now()
    )
    return list(due.order_by().values_list("webhook_id", flat=True).distinct())


def webhook_deliveries_send(*, budget_seconds: float | None = None, post: Post = http_post) -> int:
    """A round for every webhook with due deliveries, in this thread, one after the other; returns the
    attempts made. For a caller that wants the rounds done when it returns (the tests do); serve
    runs them side by side (`webhook_rounds_start`)."""
    return sum(
        webhook_round(webhook_id=webhook_id, post=post, budget_seconds=budget_seconds)
        for webhook_id in webhooks_due()
    )


class SenderThreads:
    """A FIFO of webhooks due a round, worked by a few daemon threads, with the webhooks queued or in a
    round: one round per webhook at a time in this process. Daemon threads: a stopping serve does not
    wait for a receiver; an attempt cut short is sent again by the next process (at least once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._busy: set = set()
        self._threads: list[threading.Thread] = []

    def start(self, webhook_ids: Iterable[Any], *, post: Post = http_post) -> int:
        """Queue a round for each webhook that has none queued or running; returns how many."""
        started = 0
        with self._lock:
            while len(self._threads) < settings.PALISADE_WEBHOOK_SENDER_THREADS:
                thread = threading.Thread(
                    target=self._work, name=f"webhook-sender-{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
            for webhook_id in webhook_ids:
                if webhook_id not in self._busy:
                    self._busy.add(webhook_id)
                    self._queue.put((webhook_id, post))
                    started += 1
        return started

    def busy(self) -> set:
        with self._lock:
            return set(self._busy)

    def _work(self) -> None:
        while True:
            webhook_id, post = self._queue.get()
            try:
                webhook_round(webhook_id=webhook_id, post=post)
            except DatabaseError as error:
                if not database_failed("send webhooks", error, log):
                    log.warning("cannot send to webhook %s: %s", webhook_id, str(error).splitlines()[0])
            except Exception:  # a fault of ours: its traceback, and the next round tries again
                log.exception("a round of webhook %s failed", webhook_id)
            finally:
                connections.close_all()  # this thread's: the next round may be minutes away
                with self._lock:
                    self._busy.discard(webhook_id)


SENDERS = SenderThreads()


def webhook_rounds_start(*, post: Post = http_post) -> int:
    """serve's housekeeping step: a round on a sender thread for each webhook with due deliveries and
    no round queued or running in this process; never waits for one. Returns how many were queued."""
    return SENDERS.start(webhooks_due(), post=post)

"""The sender: delivers the outbox's pending deliveries, signed the Standard Webhooks way.

- One delivery per (webhook, workload) is in flight at a time, the oldest pending one: the next event
  of a workload is not sent before the previous one was delivered or given up (order per workload).
- A delivery is claimed with `SELECT ... FOR UPDATE SKIP LOCKED` and its row stays locked while it is
  sent, so several serve processes on one PostgreSQL each send different deliveries and an event
  reaches a webhook once (at least once: a process killed after the receiver answered and before its
  commit sends it again). SQLite has no row locks: one serve process per SQLite database.
- A failed attempt (no answer, not a 2xx, a redirect: redirects are never followed) is retried after a
  delay drawn uniformly from [0, min(cap, base * 2^(attempts-1))] (exponential backoff, full jitter);
  the first failure past the give-up period (24 h) gives the delivery up, recorded.
- Each attempt is bounded: `PALISADE_WEBHOOK_TIMEOUT_SECONDS` for connecting, sending and the answer
  together, and at most `MAX_ANSWER_BYTES` of the answer's body are read.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef
from standardwebhooks.webhooks import Webhook as Signer

from controlplane import clock
from controlplane.text import visible
from controlplane.webhooks.models import Webhook, WebhookAttempt, WebhookDelivery, WebhookEvent

log = logging.getLogger("palisade.webhooks")

MAX_ANSWER_BYTES = 64 * 1024
MAX_ERROR_CHARS = 500
USER_AGENT = "Palisade-Webhooks/1"
# Deliveries claimed by one transaction: each stays locked until the batch commits.
CLAIM_BATCH = 20


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


def payload(event: WebhookEvent) -> str:
    """The body: the Standard Webhooks shape (type, timestamp, data), plus the event id."""
    return json.dumps(
        {
            "id": event.id,
            "type": event.type,
            "timestamp": clock.rfc3339(event.occurred_at),
            "data": event.data,
        },
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


# Name lookups run here, so that one that hangs is abandoned at the attempt's deadline (getaddrinfo
# itself cannot be interrupted); a few threads, so that hung lookups cannot pile up without bound.
_resolver = ThreadPoolExecutor(max_workers=4, thread_name_prefix="webhook-resolve")


def _connected(host: str, port: int, deadline: float) -> socket.socket:
    """A TCP connection to `host` made before `deadline` (monotonic), the name lookup included."""
    lookup = _resolver.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        addresses = lookup.result(timeout=max(deadline - time.monotonic(), 0.001))
    except FutureTimeout:
        raise TimeoutError(f"no address for {host} in time") from None
    failure: OSError = OSError(f"no address for {host}")
    for family, kind, protocol, _, address in addresses:
        sock = socket.socket(family, kind, protocol)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect(address)
            return sock
        except OSError as error:
            sock.close()
            failure = error
    raise failure


def http_post(url: str, *, body: bytes, headers: dict[str, str], timeout: float) -> Answer:
    """One bounded POST. http.client never follows a redirect; a 3xx is reported as the failure it is.
    The name lookup and the connection share the deadline, and a watchdog shuts the socket down at
    it, so a receiver that answers a byte at a time cannot hold the sender past it either."""
    started = time.monotonic()
    deadline = started + timeout
    parts = urlsplit(url)
    host = parts.hostname or ""
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    # The connection is made below (bounded); the class only gives the Host header its default port.
    conn = (http.client.HTTPSConnection if secure else http.client.HTTPConnection)(
        host, port, timeout=timeout
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
        conn.sock = sock = _connected(host, port, deadline)  # the watchdog can cut the handshake too
        if secure:
            conn.sock = _tls_context().wrap_socket(sock, server_hostname=host)
        conn.request(
            "POST",
            path,
            body=body,
            headers={**headers, "Content-Type": "application/json", "User-Agent": USER_AGENT},
        )
        response = conn.getresponse()
        status = response.status
        excerpt = response.read(MAX_ANSWER_BYTES)
        if 300 <= status < 400:
            location = response.getheader("Location") or ""
            error = f"redirect not followed (Location: {location})"
        elif not 200 <= status < 300:
            error = f"HTTP {status}: {excerpt[:200].decode('utf-8', 'replace')}".strip()
    except (OSError, http.client.HTTPException, ssl.SSLError) as failure:
        if time.monotonic() - started >= timeout:
            error = f"no answer within {timeout:g} s"
        else:
            error = f"{type(failure).__name__}: {failure}".strip()
    finally:
        watchdog.cancel()
        conn.close()
    duration_ms = int((time.monotonic() - started) * 1000)
    return Answer(status, visible(error)[:MAX_ERROR_CHARS], duration_ms)


def _claim(now: datetime, limit: int, *, skipping: set) -> list[WebhookDelivery]:
    earlier = WebhookDelivery.objects.filter(
        webhook_id=OuterRef("webhook_id"),
        order_key=OuterRef("order_key"),
        state=WebhookDelivery.PENDING,
        event_seq__lt=OuterRef("event_seq"),
    )
    due = (
        WebhookDelivery.objects.filter(state=WebhookDelivery.PENDING, next_attempt_at__lte=now)
        .exclude(webhook_id__in=skipping)
        .exclude(Exists(earlier))
        .order_by("event_seq", "id")
    )
    if connection.features.has_select_for_update_skip_locked:
        due = due.select_for_update(skip_locked=True, of=("self",))
    return list(due[:limit])


def webhook_deliveries_send(*, budget_seconds: float = 10.0, post=http_post) -> int:
    """Send due deliveries until none is due or the budget is spent; returns the attempts made.

    A webhook that failed once in a round gets no further attempt in that round (its other deliveries
    stay as they were): a receiver that is down costs one attempt per round, not one per event."""
    deadline = time.monotonic() + budget_seconds
    # On SQLite a claim is one delivery, committed at once: its write lock is the whole database's.
    batch = CLAIM_BATCH if connection.features.has_select_for_update_skip_locked else 1
    attempted = 0
    failing: set = set()
    while time.monotonic() < deadline:
        with transaction.atomic():
            claimed = _claim(clock.now(), batch, skipping=failing)
            if not claimed:
                return attempted
            webhooks = Webhook.objects.in_bulk([d.webhook_id for d in claimed])
            events = WebhookEvent.objects.in_bulk([d.event_id for d in claimed])
            for delivery in claimed:
                if delivery.webhook_id in failing or time.monotonic() >= deadline:
                    continue
                answer = _attempt(delivery, webhooks[delivery.webhook_id], events[delivery.event_id], post)
                attempted += 1
                if not answer.delivered:
                    failing.add(delivery.webhook_id)
    return attempted


def _hold_back(webhook: Webhook, *, until: datetime) -> None:
    """A receiver that did not answer at all (down, refusing, hanging) is not tried again for its
    other deliveries before this one's retry: otherwise each round would spend an attempt, and up to
    its whole timeout, on the next of them, and a hanging receiver would hold up every other webhook.
    A receiver that answers (even 5xx) keeps each delivery's own schedule. Rows another sender holds
    are left to it."""
    waiting = WebhookDelivery.objects.filter(
        webhook_id=webhook.id, state=WebhookDelivery.PENDING, next_attempt_at__lt=until
    )
    if connection.features.has_select_for_update_skip_locked:
        waiting = waiting.select_for_update(skip_locked=True)
    ids = list(waiting.values_list("id", flat=True))
    WebhookDelivery.objects.filter(id__in=ids).update(next_attempt_at=until)


def _attempt(delivery: WebhookDelivery, webhook: Webhook, event: WebhookEvent, post) -> Answer:
    at = clock.now()
    body = payload(event)
    headers = signed_headers(secret=webhook.secret, event_id=event.id, body=body, at=at.astimezone(UTC))
    answer = post(
        webhook.url,
        body=body.encode(),
        headers=headers,
        timeout=settings.PALISADE_WEBHOOK_TIMEOUT_SECONDS,
    )
    now = clock.now()
    delivery.attempts += 1
    next_attempt_at = None
    if answer.delivered:
        delivery.state, delivery.finished_at = WebhookDelivery.DELIVERED, now
        outcome = WebhookAttempt.DELIVERED
    elif now - delivery.created_at >= timedelta(seconds=settings.PALISADE_WEBHOOK_GIVE_UP_SECONDS):
        delivery.state, delivery.finished_at = WebhookDelivery.GAVE_UP, now
        outcome = WebhookAttempt.GAVE_UP
        log.warning(
            "gave up delivering %s %s to webhook %s after %d attempts: %s",
            event.type,
            event.id,
            webhook.id,
            delivery.attempts,
            answer.error,
        )
    else:
        delay = retry_delay(
            delivery.attempts,
            base=settings.PALISADE_WEBHOOK_RETRY_BASE_SECONDS,
            cap=settings.PALISADE_WEBHOOK_RETRY_CAP_SECONDS,
        )
        next_attempt_at = delivery.next_attempt_at = now + timedelta(seconds=delay)
        outcome = WebhookAttempt.RETRYING
    delivery.save(update_fields=["attempts", "state", "finished_at", "next_attempt_at"])
    if answer.status_code is None and next_attempt_at is not None:
        _hold_back(webhook, until=next_attempt_at)
    WebhookAttempt.objects.create(
        delivery=delivery,
        webhook_id=webhook.id,
        event_id=event.id,
        event_type=event.type,
        number=delivery.attempts,
        at=at,
        duration_ms=answer.duration_ms,
        status_code=answer.status_code,
        error=answer.error,
        outcome=outcome,
        next_attempt_at=next_attempt_at,
    )
    return answer

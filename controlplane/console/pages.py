"""What every console page shares: the login requirement, the API client, full page or HTMX partial
from the same URL, and the time ranges the flow pages offer."""

from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta
from urllib.parse import urlencode

from django.conf import settings
from django.shortcuts import redirect, render
from django_htmx.http import HttpResponseClientRedirect

from controlplane import clock
from controlplane.console.client import ApiClient, SessionEnded

RANGES = {
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
}
DEFAULT_RANGE = "24h"


def _to_login(request, reason: str = ""):
    query = {"next": request.get_full_path()}
    if reason:
        query["ended"] = "1"
    target = "/login?" + urlencode(query)
    if getattr(request, "htmx", False):
        return HttpResponseClientRedirect(target)
    return redirect(target)


def operator_page(view):
    """The view gets the API client as its second argument. No cookie, or an API 401 anywhere in the
    view (the session ended or expired), sends the operator to the login page and back afterwards."""

    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        if settings.PALISADE_SESSION_COOKIE not in request.COOKIES:
            return _to_login(request)
        try:
            return view(request, ApiClient(request), *args, **kwargs)
        except SessionEnded as ended:
            return _to_login(request, str(ended) or "ended")

    return wrapper


def go(request, target: str):
    """After a form succeeds: a redirect, or for HTMX (which would follow a redirect and swap the next
    page into the form's place) a full navigation there."""
    if getattr(request, "htmx", False):
        return HttpResponseClientRedirect(target)
    return redirect(target)


def page(request, template: str, context: dict, *, partial: str | None = None, status: int = 200):
    """The whole page, or only `partial` when HTMX asks for it (same URL, same context).

    A refusal carries the API's status to a browser without scripting; to HTMX it is a 200, since HTMX
    swaps the refusal in words either way and a 4xx would only log "failed to load" in the browser's
    console (the refusal's name is on the page, in `data-problem`)."""
    htmx = getattr(request, "htmx", False)
    chosen = partial if partial and htmx else template
    return render(request, chosen, context, status=200 if htmx else status)


def rfc3339(instant: datetime) -> str:
    return instant.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def chosen_range(params) -> dict:
    """`range` (one of RANGES) or explicit `from` and `to`, as the API's RFC 3339 strings. Bad input is
    passed through, so the API's validation problem reaches the page."""
    start, end = params.get("from", "").strip(), params.get("to", "").strip()
    if start or end:
        return {"key": "custom", "from": start, "to": end}
    key = params.get("range") if params.get("range") in RANGES else DEFAULT_RANGE
    now = clock.now().replace(microsecond=0)
    return {"key": key, "from": rfc3339(now - RANGES[key]), "to": rfc3339(now)}


def lines(text: str) -> list[str]:
    return [line.strip() for line in (text or "").splitlines() if line.strip()]


def labels_from_text(text: str) -> tuple[dict, list[str]]:
    """`key=value` lines as a label set, and the lines that are not `key=value`."""
    labels, unreadable = {}, []
    for line in lines(text):
        key, sep, value = line.partition("=")
        if not sep:
            unreadable.append(f"'{line}' is not key=value")
            continue
        labels[key.strip()] = value.strip()
    return labels, unreadable

"""Webhooks: listed with their backlog, created with the signing secret shown once, each with its recent
deliveries, deleted after a confirmation step. Everything through the operator API (docs/webhooks.md)."""

from __future__ import annotations

from django.views.decorators.http import require_GET, require_http_methods

from controlplane.console.confirm import Confirmation, ask, confirmed
from controlplane.console.pages import operator_page, page
from controlplane.console.views.fleet import not_found
from controlplane.text import visible

RECENT_DELIVERIES = 50  # one page of attempts, newest first: what an operator looks at to see why
_vocabulary: tuple[str, ...] = ()  # the API's event types, read once from its OpenAPI document


def event_types(api) -> list[str]:
    """The event types `POST /webhooks` admits, as the API's own OpenAPI document lists them (found from
    the operation `webhooks_create`), so that the form offers exactly what the API accepts: the console
    imports nothing from the webhooks domain. Read once per process; a failed read is tried again."""
    global _vocabulary
    if not _vocabulary:
        schema = api.get("/schema", params={"format": "json"})
        if schema.ok and isinstance(schema.data, dict):
            # One assignment: two requests reading it at once each set the same whole tuple.
            _vocabulary = tuple(_create_events_enum(schema.data))
    return list(_vocabulary)


def _create_events_enum(document: dict) -> list[str]:
    schemas = document.get("components", {}).get("schemas", {})

    def resolved(node: dict) -> dict:
        ref = str(node.get("$ref", ""))
        return schemas.get(ref.rsplit("/", 1)[-1], {}) if ref else node

    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            if isinstance(operation, dict) and operation.get("operationId") == "webhooks_create":
                body = operation["requestBody"]["content"]["application/json"]["schema"]
                events = resolved(body).get("properties", {}).get("events", {})
                return [str(value) for value in resolved(events.get("items", {})).get("enum", [])]
    return []


def _listing(api) -> list[dict]:
    return api.get_all("/webhooks").data["items"]


def _create_body(form) -> dict:
    body: dict = {"url": form.get("url", "").strip(), "events": form.getlist("events")}
    if form.get("description", "").strip():
        body["description"] = form["description"].strip()
    return body


def _render(request, api, context: dict, *, status: int = 200):
    context.setdefault("created", None)
    context.setdefault("problem", None)
    context.setdefault("errors", {})
    context.setdefault("form", {})
    context.setdefault("chosen", [])
    context.update(webhooks=_listing(api), event_types=event_types(api))
    return page(request, "console/webhooks.html", context, status=status)


@require_http_methods(["GET", "POST"])
@operator_page
def webhooks(request, api):
    if request.method != "POST":
        return _render(request, api, {})
    body = _create_body(request.POST)
    result = api.post("/webhooks", body)
    if result.ok:
        # Shown in this response only: nothing here stores it, and the API never shows it again.
        return _render(request, api, {"created": result.data})
    return _render(
        request, api,
        {"problem": result.problem, "errors": result.findings_by_field(), "form": request.POST,
         "chosen": body["events"]},
        status=result.status,
    )  # fmt: skip


@require_GET
@operator_page
def webhook_detail(request, api, webhook_id: str):
    found = api.get(f"/webhooks/{webhook_id}")
    if not found.ok:
        return not_found(request, f"webhook {webhook_id}")
    attempts = api.get(f"/webhooks/{webhook_id}/deliveries", params={"limit": RECENT_DELIVERIES})
    items = attempts.data["items"] if attempts.ok else []
    for attempt in items:
        attempt["outcome_text"] = str(attempt["outcome"]).replace("_", " ")  # "gave up"
        # Attempt 0 records a delivery given up unsent (over the backlog cap, or with the rest of a
        # receiver given up on): its error says which.
        attempt["attempt_text"] = attempt["attempt"] or "—"
    context = {
        "webhook": found.data,
        "attempts": items,
        "more": bool(attempts.ok and attempts.data.get("next_cursor")),
        "problem": attempts.problem,
    }
    return page(request, "console/webhook.html", context)


@require_http_methods(["GET", "POST"])
@operator_page
def webhook_delete(request, api, webhook_id: str):
    if not confirmed(request):
        found = api.get(f"/webhooks/{webhook_id}")
        if not found.ok:
            return not_found(request, f"webhook {webhook_id}")
        webhook = found.data
        url = visible(webhook["url"])  # the confirmation page shows text as it is given
        pending = (webhook.get("deliveries") or {}).get("pending", 0)
        described = f" (“{visible(webhook['description'])}”)" if webhook["description"] else ""
        return ask(
            request,
            Confirmation(
                title=f"Delete webhook {url}",
                summary=f"Delete the webhook to {url}{described}: it receives no more events.",
                consequences=[
                    f"{pending} pending deliver{'y' if pending == 1 else 'ies'} to it and its delivery "
                    "history are deleted with it.",
                    "Webhooks subscribed to webhook.deleted are told.",
                ],
                action=f"/webhooks/{webhook_id}/delete",
                cancel=f"/webhooks/{webhook_id}",
                button="Delete the webhook",
            ),
        )
    result = api.delete(f"/webhooks/{webhook_id}")
    return _render(
        request,
        api,
        {"problem": result.problem, "deleted": result.ok},
        status=200 if result.ok else result.status,
    )

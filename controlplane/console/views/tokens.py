"""Tokens (provisioning and operator: listed by prefix, minted with the secret shown once, revoked)
and the About page."""

from __future__ import annotations

from django.views.decorators.http import require_GET, require_http_methods

from controlplane.console.confirm import Confirmation, ask, confirmed
from controlplane.console.pages import labels_from_text, operator_page, page
from controlplane.console.views.fleet import not_found
from controlplane.validation import is_digits

KINDS = {"provisioning": "/provisioning-tokens", "operator": "/operator-tokens"}


def _listings(api) -> dict:
    return {
        "provisioning_tokens": api.get_all("/provisioning-tokens").data["items"],
        "operator_tokens": api.get_all("/operator-tokens").data["items"],
    }


def _mint_body(kind: str, form) -> dict:
    if kind == "operator":
        body = {"name": form.get("name", "")}
    else:
        body = {"description": form.get("description", "")}
        if form.get("max_uses", "").strip():
            body["max_uses"] = (
                int(form["max_uses"]) if is_digits(form["max_uses"].strip()) else form["max_uses"]
            )
        labels, _ = labels_from_text(form.get("labels", ""))
        if labels:
            body["labels"] = labels
        if form.get("workload_id", "").strip():
            body["workload_id"] = form["workload_id"].strip()
    if form.get("expires_at", "").strip():
        body["expires_at"] = form["expires_at"].strip()
    return body


@require_http_methods(["GET", "POST"])
@operator_page
def tokens(request, api):
    context: dict = {"minted": None, "problem": None, "kind": None, "form": {}}
    status = 200
    if request.method == "POST":
        kind = request.POST.get("kind", "")
        unreadable = labels_from_text(request.POST.get("labels", ""))[1]
        if kind == "provisioning" and unreadable:
            status = 422
            context.update(kind=kind, form=request.POST,
                           problem={"name": "validation", "title": "Labels", "detail": "; ".join(unreadable)})  # fmt: skip
        elif kind in KINDS:
            result = api.post(KINDS[kind], _mint_body(kind, request.POST))
            context["kind"] = kind
            if result.ok:
                # Shown in this response only: the API keeps a digest, and nothing here stores it.
                context["minted"] = result.data
            else:
                status = result.status
                context.update(problem=result.problem, form=request.POST)
    context.update(_listings(api))
    return page(request, "console/tokens.html", context, status=status)


def _described(kind: str, token: dict) -> tuple[str, str]:
    if kind == "operator":
        return f"operator token {token['prefix']} (“{token['name']}”)", (
            "Scripts that use it stop working at once: their next request is refused."
        )
    uses = f"{token['uses']} of {token['max_uses']}" if token.get("max_uses") else f"{token['uses']}"
    return f"provisioning token {token['prefix']} (“{token['description']}”, used {uses} times)", (
        "Agents can no longer enrol with it; the workloads it already enrolled are not touched."
    )


@require_http_methods(["GET", "POST"])
@operator_page
def token_revoke(request, api, kind: str, token_id: str):
    if not confirmed(request):
        listing = api.get_all(KINDS[kind])
        token = next((t for t in listing.data["items"] if t["id"] == token_id), None) if listing.ok else None
        if token is None:
            return not_found(request, f"{kind} token {token_id}")
        what, effect = _described(kind, token)
        return ask(
            request,
            Confirmation(
                title=f"Revoke {what.split(' (')[0]}",
                summary=f"Revoke {what}. {effect}",
                action=f"/tokens/{kind}/{token_id}/revoke",
                cancel="/tokens",
                button="Revoke the token",
            ),
        )
    result = api.delete(f"{KINDS[kind]}/{token_id}")
    context = {"minted": None, "problem": result.problem, "kind": kind, "form": {}, "revoked": result.ok}
    context.update(_listings(api))
    return page(request, "console/tokens.html", context, status=200 if result.ok else result.status)


@require_GET
@operator_page
def about(request, api):
    return page(request, "console/about.html", {"me": api.get("/me").data})

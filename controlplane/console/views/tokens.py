"""Tokens (provisioning and operator: listed by prefix, minted with the secret shown once, revoked)
and the About page."""

from __future__ import annotations

from django.views.decorators.http import require_GET, require_http_methods, require_POST

from controlplane.console.pages import labels_from_text, operator_page, page
from controlplane.validation import is_digits

KINDS = {"provisioning": "/provisioning-tokens", "operator": "/operator-tokens"}


def _listings(api) -> dict:
    return {
        "provisioning_tokens": api.get("/provisioning-tokens", params={"limit": 500}).data["items"],
        "operator_tokens": api.get("/operator-tokens", params={"limit": 500}).data["items"],
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


@require_POST
@operator_page
def token_revoke(request, api, kind: str, token_id: str):
    result = api.delete(f"{KINDS[kind]}/{token_id}")
    context = {"minted": None, "problem": result.problem, "kind": kind, "form": {}, "revoked": result.ok}
    context.update(_listings(api))
    return page(request, "console/tokens.html", context, status=200 if result.ok else result.status)


@require_GET
@operator_page
def about(request, api):
    return page(request, "console/about.html", {"me": api.get("/me").data})

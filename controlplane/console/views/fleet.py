"""The fleet page and one workload's page: state, chips, labels, rendered policy, resend, flows."""

from __future__ import annotations

from urllib.parse import urlencode

from django.http import Http404
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from controlplane.console.chips import workload_chips
from controlplane.console.confirm import Confirmation, ask, confirmed
from controlplane.console.pages import RANGES, chosen_range, labels_from_text, operator_page, page
from controlplane.console.views.evidence import plot_of
from controlplane.validation import is_digits

GROUPS_LISTED = 200
GAPS_LISTED = 100
SYNC_STATES = ("synced", "pending", "degraded", "offline")
MODES = ("visibility", "simulation", "enforced")


def fleet_filters(params) -> dict:
    return {
        "label": [value for value in params.getlist("label") if value.strip()],
        "sync_state": params.get("sync_state", "") if params.get("sync_state") in SYNC_STATES else "",
        "outbound_mode": params.get("outbound_mode", "") if params.get("outbound_mode") in MODES else "",
        "removed": params.get("removed", "") if params.get("removed") in ("true", "false") else "",
        "limit": params.get("limit", "") if is_digits(params.get("limit", "")) else "",
    }


def with_chips(workloads: list[dict]) -> list[dict]:
    return [{**workload, "chips": workload_chips(workload)} for workload in workloads]


@require_GET
@operator_page
def fleet(request, api):
    filters = fleet_filters(request.GET)
    query = {key: value for key, value in filters.items() if value}
    cursor = request.GET.get("cursor", "")
    listing = api.get("/workloads", params={**query, **({"cursor": cursor} if cursor else {})})
    counts = api.get("/workloads/counts")
    context = {
        "filters": filters,
        "sync_states": SYNC_STATES,
        "modes": MODES,
        "counts": counts.data if counts.ok else None,
        "problem": listing.problem,
        "workloads": with_chips(listing.data["items"]) if listing.ok else [],
        "next_query": urlencode({**query, "cursor": listing.data["next_cursor"]}, doseq=True)
        if listing.ok and listing.data["next_cursor"]
        else "",
        "first_query": urlencode(query, doseq=True),
        "this_query": request.GET.urlencode(),
        "paged": bool(cursor),
    }
    return page(request, "console/fleet.html", context, partial="console/partials/fleet_body.html")


def not_found(request, what: str):
    return page(request, "console/not_found.html", {"what": what}, status=404)


def page_not_found(request):
    """A person's browser gets the console's page; anything else (a script, an agent on the wrong
    listener) the API's `not-found` problem, as for every unknown path."""
    if "text/html" not in request.META.get("HTTP_ACCEPT", ""):
        raise Http404(request.path)
    return operator_page(lambda request, api: not_found(request, f"page at {request.path}"))(request)


def _labels_text(labels: dict) -> str:
    return "\n".join(f"{key}={value}" for key, value in sorted(labels.items()))


@require_GET
@operator_page
def workload(request, api, workload_id: str):
    found = api.get(f"/workloads/{workload_id}")
    if not found.ok:
        return not_found(request, f"workload {workload_id}")
    item = found.data
    labels = api.get(f"/workloads/{workload_id}/labels").data
    policy = api.get(f"/workloads/{workload_id}/rendered-policy").data
    return page(
        request,
        "console/workload.html",
        {
            "workload": {**item, "chips": workload_chips(item)},
            "labels_form": {"text": _labels_text(labels["labels"]), "version": labels["version"]},
            "policy": policy,
            "rule_index": sorted((policy.get("rule_index") or {}).items(), key=lambda kv: int(kv[0])),
            **workload_flows(api, workload_id, request.GET),
        },
        partial="console/partials/workload_flows.html" if request.GET.get("part") == "flows" else None,
    )


def workload_flows(api, workload_id: str, params) -> dict:
    span = chosen_range(params)
    selection = {"workload": workload_id, "from": span["from"], "to": span["to"]}
    plot = plot_of(api, selection, span)
    groups = api.get(
        "/flows/rollup",
        params={**selection, "group_by": ["peer", "service", "decision", "rule"], "limit": GROUPS_LISTED},
    )
    gaps = api.get("/flows/gaps", params={**selection, "limit": GAPS_LISTED})
    return {
        "span": span,
        "ranges": list(RANGES),
        "flows_problem": plot["plot_problem"] or groups.problem or gaps.problem,
        **plot,
        "groups": groups.data if groups.ok else None,
        "groups_more": bool(groups.ok and groups.data["next_cursor"]),
        "flows_link": urlencode(
            {
                "workloads": workload_id,
                "group_by": ["peer", "service", "decision", "rule"],
                **(
                    {"from": span["from"], "to": span["to"]}
                    if span["key"] == "custom"
                    else {"range": span["key"]}
                ),
            },
            doseq=True,
        ),  # fmt: skip
        "gaps": gaps.data["items"] if gaps.ok else [],
        "gaps_truncated": bool(gaps.ok and gaps.data["next_cursor"]),
    }


@require_http_methods(["POST"])
@operator_page
def workload_labels(request, api, workload_id: str):
    labels, unreadable = labels_from_text(request.POST.get("labels", ""))
    version = request.POST.get("version", "")
    form = {"text": request.POST.get("labels", ""), "version": version}
    context = {"workload": {"id": workload_id}, "labels_form": form, "saved": False}
    if unreadable:
        context["findings"] = unreadable
        return page(request, "console/labels.html", context, partial="console/partials/labels_form.html")
    result = api.put(f"/workloads/{workload_id}/labels", {"labels": labels}, if_match=version)
    if result.ok:
        form.update(text=_labels_text(result.data["labels"]), version=result.data["version"])
        context["saved"] = True
    else:
        context["problem"] = result.problem
        context["findings"] = [f"{f['path']}: {f['message']}" for f in result.problem.get("errors") or []]
        if result.problem["name"] == "precondition-failed":
            current = api.get(f"/workloads/{workload_id}/labels").data
            context["current"] = {"text": _labels_text(current["labels"]), "version": current["version"]}
    return page(request, "console/labels.html", context, partial="console/partials/labels_form.html")


@require_POST
@operator_page
def workload_resend(request, api, workload_id: str):
    result = api.post(f"/workloads/{workload_id}/resend-snapshot")
    context = {"workload": {"id": workload_id}, "result": result.data if result.ok else None}
    context["problem"] = result.problem
    return page(request, "console/resend.html", context, partial="console/partials/resend_result.html")


@require_POST
@operator_page
def workload_revoke_credential(request, api, workload_id: str):
    reason = request.POST.get("reason", "").strip()
    if not confirmed(request):
        workload = api.get(f"/workloads/{workload_id}")
        if not workload.ok:
            return not_found(request, f"workload {workload_id}")
        name = workload.data.get("hostname") or workload_id
        return ask(
            request,
            Confirmation(
                title=f"Revoke the credential of {name}",
                summary=(
                    f"Revoke the credential of {name}: its stream closes at once, and its flow reports and "
                    "renewals are refused."
                ),
                consequences=[
                    "Its table stays as it is on the host (fail static); the workload stays in the fleet.",
                    "It comes back only by a re-enrolment with a provisioning token minted for it.",
                    f"Reason shown on the workload: {reason}" if reason else "No reason given.",
                ],
                action=f"/workloads/{workload_id}/revoke-credential",
                cancel=f"/workloads/{workload_id}",
                button="Revoke the credential",
                fields={"reason": reason},
            ),
        )
    result = api.post(f"/workloads/{workload_id}/revoke-credential", {"reason": reason} if reason else {})
    context = {"workload": {"id": workload_id}, "revoked": result.data if result.ok else None}
    context["problem"] = result.problem
    return page(
        request,
        "console/revoke_credential.html",
        context,
        status=200 if result.ok else result.status,
    )

"""Mode changes (with the simulation review before enforcing), the review page and the flows page."""

from __future__ import annotations

import csv
import io

from django.http import HttpResponse
from django.views.decorators.http import require_GET, require_http_methods

from controlplane.console.chips import workload_chips
from controlplane.console.pages import RANGES, chosen_range, lines, operator_page, page
from controlplane.console.plots import connections_plot

GROUPINGS = ("workload", "peer", "peer_workload", "service", "decision", "rule", "ruleset")
MODES = ("visibility", "simulation", "enforced")


def selection_form(params) -> dict:
    """Labels (one requirement per line, ANDed) and workload ids (one per line), as typed."""
    return {"labels": params.get("labels", ""), "workloads": params.get("workloads", "")}


def selection_query(form: dict) -> dict:
    return {"label": lines(form["labels"]), "workload": lines(form["workloads"])}


def selected_workloads(api, form: dict) -> tuple[list[dict], bool, dict | None]:
    """The workloads a selection names now (first page of the fleet read), whether there are more,
    and the problem if the API refused the selection."""
    query = selection_query(form)
    if not query["workload"]:
        result = api.get("/workloads", params={"label": query["label"], "limit": 100})
        if not result.ok:
            return [], False, result.problem
        return result.data["items"], bool(result.data["next_cursor"]), None
    # Ids narrow the labels (as in the mode change): read each named workload, then keep those the
    # label requirements also select.
    items = []
    for workload_id in query["workload"][:100]:
        found = api.get(f"/workloads/{workload_id}")
        if not found.ok:
            return [], False, {**found.problem, "detail": f"No workload {workload_id}."}
        items.append(found.data)
    if query["label"]:
        matching = api.get("/workloads", params={"label": query["label"], "limit": 500})
        if not matching.ok:
            return [], False, matching.problem
        selected = {w["id"] for w in matching.data["items"]}
        items = [w for w in items if w["id"] in selected]
    return items, len(query["workload"]) > 100, None


def review_of(api, form: dict, span: dict):
    return api.get("/flows/review", params={**selection_query(form), "from": span["from"], "to": span["to"]})


@require_http_methods(["GET", "POST"])
@operator_page
def mode_changes(request, api):
    params = request.POST if request.method == "POST" else request.GET
    form = {**selection_form(params), "mode": params.get("mode", "simulation")}
    span = chosen_range(params)
    context: dict = {"form": form, "modes": MODES, "span": span, "ranges": list(RANGES)}
    if form["labels"] or form["workloads"]:
        context["workloads"], context["more"], context["problem"] = selected_workloads(api, form)
        for workload in context["workloads"]:
            workload["chips"] = workload_chips(workload)
    if form["mode"] == "enforced" and (form["labels"] or form["workloads"]):
        review = review_of(api, form, span)
        context["review"] = review.data if review.ok else None
        context["review_problem"] = review.problem
    if request.method == "POST" and not context.get("problem"):
        failing = form["mode"] == "enforced" and (context.get("review") or {}).get("verdict") != "pass"
        if failing and params.get("confirm") != "enforce-despite-review":
            context["needs_confirmation"] = True
        else:
            selection = selection_query(form)
            body = {"mode": form["mode"], "selection": {}}
            if selection["label"]:
                body["selection"]["labels"] = selection["label"]
            if selection["workload"]:
                body["selection"]["workload_ids"] = selection["workload"]
            result = api.post("/mode-changes", body)
            context["intent"] = result.data if result.ok else None
            context["problem"] = result.problem
    return page(
        request, "console/mode_changes.html", context, partial="console/partials/mode_change_body.html"
    )


@require_GET
@operator_page
def convergence(request, api):
    """The selection's workloads, applied vs latest; the mode-change page polls it after a change."""
    form = selection_form(request.GET)
    workloads, more, problem = selected_workloads(api, form)
    for workload in workloads:
        workload["chips"] = workload_chips(workload)
    converged = sum(
        1 for w in workloads if w["applied_version"] and w["applied_version"] == w["latest_version"]
    )
    return page(
        request,
        "console/partials/convergence.html",
        {"workloads": workloads, "more": more, "problem": problem, "converged": converged,
         "query": request.GET.urlencode()},
    )  # fmt: skip


@require_GET
@operator_page
def review(request, api):
    form = selection_form(request.GET)
    span = chosen_range(request.GET)
    result = review_of(api, form, span) if "from" in request.GET or "range" in request.GET else None
    context = {
        "form": form,
        "span": span,
        "ranges": list(RANGES),
        "review": result.data if result is not None and result.ok else None,
        "problem": result.problem if result is not None else None,
    }
    return page(request, "console/review.html", context)


def _rollup_csv(items: list[dict], group_by: list[str]) -> HttpResponse:
    keys = [k for k in ("workload_id", "window_start", "peer", "peer_workload_id", "decision",
                        "rule_number", "rule_id", "ruleset_id") if any(k in row for row in items)]  # fmt: skip
    with_service = any("service" in row for row in items)
    out = io.StringIO()
    writer = csv.writer(out)
    header = keys + (["protocol", "port"] if with_service else [])
    writer.writerow(header + ["connection_count", "bytes_in", "bytes_out", "first_seen", "last_seen"])
    for row in items:
        service = row.get("service") or {}
        writer.writerow(
            [row.get(k) if row.get(k) is not None else "" for k in keys]
            + ([service.get("protocol", ""), service.get("port", "")] if with_service else [])
            + [
                row["connection_count"],
                row["bytes_in"],
                row["bytes_out"],
                row["first_seen"],
                row["last_seen"],
            ]
        )
    response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="palisade-flows-{"-".join(group_by)}.csv"'
    return response


def _gaps_csv(gaps: list[dict]) -> HttpResponse:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["workload_id", "kind", "source", "start", "end", "lost"])
    for gap in gaps:
        lost = "; ".join(f"{n} {what}" for what, n in (gap.get("lost") or {}).items())
        writer.writerow(
            [gap["workload_id"], gap["kind"], gap["source"] or "", gap["start"], gap["end"], lost]
        )
    response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="palisade-evidence-gaps.csv"'
    return response


@require_GET
@operator_page
def flows(request, api):
    form = selection_form(request.GET)
    span = chosen_range(request.GET)
    group_by = [g for g in request.GET.getlist("group_by") if g in GROUPINGS] or ["peer", "service"]
    selection = {**selection_query(form), "from": span["from"], "to": span["to"]}
    cursor = request.GET.get("cursor", "")
    rollup = api.get(
        "/flows/rollup",
        params={**selection, "group_by": group_by, "limit": 500 if request.GET.get("export") else 100,
                **({"cursor": cursor} if cursor else {})},
    )  # fmt: skip
    gaps = api.get("/flows/gaps", params={**selection, "limit": 500})
    if request.GET.get("export") == "rollup" and rollup.ok:
        return _rollup_csv(rollup.data["items"], group_by)
    if request.GET.get("export") == "gaps" and gaps.ok:
        return _gaps_csv(gaps.data["items"])
    series = api.get("/flows/rollup", params={**selection, "group_by": ["window", "decision"], "limit": 500})
    rules = api.get("/flows/rollup", params={**selection, "group_by": ["rule"], "limit": 500})
    query = request.GET.copy()
    query.pop("cursor", None)
    context = {
        "form": form,
        "span": span,
        "ranges": list(RANGES),
        "groupings": GROUPINGS,
        "group_by": group_by,
        "rollup": rollup.data if rollup.ok else None,
        "problem": rollup.problem or gaps.problem,
        "gaps": gaps.data["items"] if gaps.ok else [],
        "plot": connections_plot(series.data["items"], start=span["from"], end=span["to"])
        if series.ok
        else None,
        "rules": rules.data if rules.ok else None,
        "rule_hits": [row for row in rules.data["items"] if row.get("rule_number")] if rules.ok else [],
        "query": query.urlencode(),
        "next_cursor": rollup.data["next_cursor"] if rollup.ok else None,
    }
    return page(request, "console/flows.html", context)

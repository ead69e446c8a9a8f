"""Mode changes (with the simulation review before enforcing), the review page and the flows page."""

from __future__ import annotations

import math

from django.http import HttpResponse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from controlplane import clock
from controlplane.console.chips import parse_instant, workload_chips
from controlplane.console.client import PAGE_LIMIT
from controlplane.console.impact import refused_when_enforced, refused_words
from controlplane.console.pages import RANGES, chosen_range, lines, operator_page, page
from controlplane.console.plots import connections_plot
from flows.csv_rows import GAP_COLUMNS, csv_text, rollup_columns, rollup_row

LISTED = 200  # workloads named on the page; the counts are over all of them
PLOT_ROWS = 12_000  # window-by-decision rows a plot reads at most (a day of minute windows is 5,760)
GROUPINGS = ("workload", "peer", "peer_workload", "service", "decision", "rule", "ruleset")
MODES = ("visibility", "simulation", "enforced")
CONFIRM_WITHIN_DEFAULT = "300"  # seconds: time enough to check a workload is still reachable


def selection_form(params) -> dict:
    """Labels (one requirement per line, ANDed) and workload ids (one per line), as typed."""
    return {"labels": params.get("labels", ""), "workloads": params.get("workloads", "")}


def selection_query(form: dict) -> dict:
    return {"label": lines(form["labels"]), "workload": lines(form["workloads"])}


def selected_workloads(api, form: dict) -> dict:
    """The workloads a selection names now, all of them: the API resolves labels and ids together
    (`GET /workloads?label=...&id=...`, every page), as the mode change itself will. `named_missing`:
    ids typed that the selection does not hold (no such workload, or labels that do not match)."""
    query = selection_query(form)
    result = api.get_all("/workloads", params={"label": query["label"], "id": query["workload"]})
    if not result.ok:
        return {"workloads": [], "total": 0, "named_missing": [], "problem": result.problem}
    items = result.data["items"]
    found = {w["id"] for w in items}
    missing = [w for w in dict.fromkeys(query["workload"]) if w.lower() not in found]
    return {"workloads": items, "total": len(items), "named_missing": missing, "problem": None}


def review_of(api, form: dict, span: dict):
    """The review of the form's direction (inbound when it has none): an outbound change to enforced is
    judged on outbound evidence and the outbound mode."""
    direction = {"direction": form["direction"]} if form.get("direction", "inbound") != "inbound" else {}
    return api.get(
        "/flows/review",
        params={**selection_query(form), "from": span["from"], "to": span["to"], **direction},
    )


@require_http_methods(["GET", "POST"])
@operator_page
def mode_changes(request, api):
    params = request.POST if request.method == "POST" else request.GET
    form = {
        **selection_form(params),
        "mode": params.get("mode", "simulation"),
        "direction": "outbound" if params.get("direction") == "outbound" else "inbound",
        "with_confirmation": params.get("with_confirmation") == "yes",
        "confirm_within": params.get("confirm_within", CONFIRM_WITHIN_DEFAULT).strip(),
    }
    span = chosen_range(params)
    context: dict = {
        "form": form,
        "modes": MODES,
        "directions": ("inbound", "outbound"),
        "span": span,
        "ranges": list(RANGES),
    }
    # Each direction's change to enforced is gated by that direction's review; the impact panel (what
    # enforcing would refuse, by the classifier) is drawn for inbound changes only.
    inbound = form["direction"] == "inbound"
    if form["labels"] or form["workloads"]:
        selected = selected_workloads(api, form)
        context.update(selected, workloads=selected["workloads"][:LISTED])
    if form["mode"] == "enforced" and (form["labels"] or form["workloads"]):
        review = review_of(api, form, span)
        context["review"] = review.data if review.ok else None
        context["review_problem"] = review.problem
    if inbound and form["mode"] == "enforced" and (form["labels"] or form["workloads"]):
        refused, problem = refused_when_enforced(api, selection_query(form), span)
        context.update(enforced_impact=refused, enforced_impact_problem=problem)
        if refused is not None:
            context["enforced_words"] = refused_words(refused, span)
    if request.method == "POST" and not context.get("problem"):
        failing = form["mode"] == "enforced" and (context.get("review") or {}).get("verdict") != "pass"
        if failing and params.get("confirm") != "enforce-despite-review":
            context["needs_confirmation"] = True
        else:
            selection = selection_query(form)
            body = {"mode": form["mode"], "selection": {}}
            if not inbound:
                body["direction"] = form["direction"]
            if selection["label"]:
                body["selection"]["labels"] = selection["label"]
            if selection["workload"]:
                body["selection"]["workload_ids"] = selection["workload"]
            if form["with_confirmation"]:
                # As typed, when not a number: the API's finding says what it takes.
                within = form["confirm_within"]
                body["confirm_within_seconds"] = int(within) if within.isdigit() else within
            result = api.post("/mode-changes", body)
            context["intent"] = countdown_of(result.data) if result.ok else None
            context["problem"] = result.problem
    context["awaiting"] = awaiting_confirmation(api, besides=(context.get("intent") or {}).get("id"))
    return page(
        request, "console/mode_changes.html", context, partial="console/partials/mode_change_body.html"
    )


def countdown_of(change: dict) -> dict:
    """A mode change as its confirmation block shows it, with the whole seconds left before its
    deadline while it awaits confirmation (0: passed, the revert is due)."""
    left = None
    if change.get("confirmation") == "awaiting":
        deadline = parse_instant(change["confirm_by"])
        left = max(0, math.ceil((deadline - clock.now()).total_seconds())) if deadline else 0
    return {**change, "seconds_left": left}


def awaiting_confirmation(api, *, besides: str | None = None) -> list[dict]:
    """Every mode change awaiting confirmation, so that one made earlier (in another tab, by a script)
    is never out of sight while its deadline runs."""
    result = api.get_all("/mode-changes", params={"confirmation": "awaiting"})
    if not result.ok:
        return []
    return [countdown_of(change) for change in result.data["items"] if change["id"] != besides]


def _mode_change_page(request, api, mode_change_id: str, *, problem: dict | None = None, status: int = 200):
    found = api.get(f"/mode-changes/{mode_change_id}")
    if not found.ok:
        return page(request, "console/not_found.html", {"what": f"mode change {mode_change_id}"}, status=404)
    change = countdown_of(found.data)
    revert = None
    if change["reverted_by"]:
        reverted = api.get(f"/mode-changes/{change['reverted_by']}")
        revert = reverted.data if reverted.ok else None
    context = {"change": change, "revert": revert, "problem": problem}
    return page(
        request,
        "console/mode_change.html",
        context,
        partial="console/partials/confirmation.html",
        status=status,
    )


@require_GET
@operator_page
def mode_change(request, api, mode_change_id: str):
    """One mode change: its facts, its workloads, and while it awaits confirmation the countdown and
    the Confirm button (HTMX polls the block every second, and stops once it is settled)."""
    return _mode_change_page(request, api, mode_change_id)


@require_POST
@operator_page
def mode_change_confirm(request, api, mode_change_id: str):
    result = api.post(f"/mode-changes/{mode_change_id}/confirm")
    return _mode_change_page(request, api, mode_change_id, problem=result.problem, status=result.status)


@require_GET
@operator_page
def convergence(request, api):
    """The selection's workloads, applied vs latest; the mode-change page polls it after a change.
    Counted over the whole selection; the table lists those still behind first."""
    selected = selected_workloads(api, selection_form(request.GET))
    workloads = selected["workloads"]
    converged = [w for w in workloads if w["applied_version"] and w["applied_version"] == w["latest_version"]]
    behind = [w for w in workloads if w not in converged]
    listed = [{**w, "chips": workload_chips(w)} for w in (behind + converged)[:LISTED]]
    return page(
        request,
        "console/partials/convergence.html",
        {**selected, "workloads": listed, "converged": len(converged), "query": request.GET.urlencode()},
    )


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


def _csv_response(text: str, filename: str) -> HttpResponse:
    response = HttpResponse(text, content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def plot_of(api, selection: dict, span: dict) -> dict:
    """The connections-per-window plot of a selection over a range, from every page of the rollup by
    window and decision, up to PLOT_ROWS rows; past that the page says where the plot stops."""
    series = api.get_all(
        "/flows/rollup", params={**selection, "group_by": ["window", "decision"]}, cap=PLOT_ROWS
    )
    if not series.ok:
        return {"plot": None, "plot_problem": series.problem}
    items = series.data["items"]
    cut = bool(series.data["next_cursor"])
    return {
        "plot": connections_plot(items, start=span["from"], end=span["to"]),
        "plot_cut_at": max(row["window_start"] for row in items) if cut and items else None,
        "plot_problem": None,
    }


@require_GET
@operator_page
def flows(request, api):
    form = selection_form(request.GET)
    span = chosen_range(request.GET)
    group_by = [g for g in request.GET.getlist("group_by") if g in GROUPINGS] or ["peer", "service"]
    selection = {**selection_query(form), "from": span["from"], "to": span["to"]}
    export = request.GET.get("export")
    if export == "rollup":  # every row of the rollup, not the page shown
        everything = api.get_all("/flows/rollup", params={**selection, "group_by": group_by})
        if everything.ok:
            rows = [rollup_row(item) for item in everything.data["items"]]
            return _csv_response(
                csv_text(rollup_columns(group_by), rows), f"palisade-flows-{'-'.join(group_by)}.csv"
            )
    if export == "gaps":
        everything = api.get_all("/flows/gaps", params=selection)
        if everything.ok:
            return _csv_response(
                csv_text(GAP_COLUMNS, everything.data["items"]), "palisade-evidence-gaps.csv"
            )
    cursor = request.GET.get("cursor", "")
    rollup = api.get(
        "/flows/rollup",
        params={**selection, "group_by": group_by, "limit": 100, **({"cursor": cursor} if cursor else {})},
    )
    gaps = api.get("/flows/gaps", params={**selection, "limit": PAGE_LIMIT})
    rules = api.get_all("/flows/rollup", params={**selection, "group_by": ["rule"]})
    plot = plot_of(api, selection, span)
    query = request.GET.copy()
    query.pop("cursor", None)
    query.pop("export", None)
    context = {
        "form": form,
        "span": span,
        "ranges": list(RANGES),
        "groupings": GROUPINGS,
        "group_by": group_by,
        "rollup": rollup.data if rollup.ok else None,
        "problem": rollup.problem or gaps.problem or plot["plot_problem"] or rules.problem,
        "gaps": gaps.data["items"] if gaps.ok else [],
        "gaps_truncated": bool(gaps.ok and gaps.data["next_cursor"]),
        **plot,
        "rules": rules.data if rules.ok else None,
        "rule_hits": [row for row in rules.data["items"] if row.get("rule_number")] if rules.ok else [],
        "query": query.urlencode(),
        "next_cursor": rollup.data["next_cursor"] if rollup.ok else None,
    }
    return page(request, "console/flows.html", context)

"""Suggest rules: the API's proposal learnt from the stored flows (POST /policies/suggestions), read
with its evidence and coverage, edited as JSON, then saved through the ordinary writes (address
groups first, then rulesets), and a link to put the workloads in `simulation`."""

from __future__ import annotations

import json
from urllib.parse import urlencode

from django.views.decorators.http import require_http_methods

from controlplane.console import policy_forms as forms
from controlplane.console.pages import RANGES, chosen_range, operator_page, page
from controlplane.console.views.evidence import selection_form, selection_query

SUGGEST_RANGE = "7d"  # a week holds the weekly jobs a day would miss


def _request_body(form: dict, span: dict) -> dict:
    body: dict = {**selection_query(form), "from": span["from"], "to": span["to"]}
    keys = [k.strip() for k in form["label_keys"].replace(",", " ").split() if k.strip()]
    if keys:
        body["label_keys"] = keys
    for name in ("aggregate_prefix", "aggregate_prefix_v6"):
        text = form[name].strip()
        if text:
            # Typed text that is not a number goes as it is: the API's finding names the field.
            body[name] = int(text) if text.isdigit() else text
    return body


def _proposed(proposal: dict) -> list[dict]:
    """Each proposed ruleset with its rules beside their evidence (the answer lists both in the same
    order), sources and services written as the rule form writes them."""
    shown = []
    for ruleset, evidence in zip(proposal["rulesets"], proposal["evidence"], strict=False):
        rules = [
            {
                "sources_text": forms.sources_text(rule["sources"], {}),
                "services_text": forms.rule_services_text(rule["services"], {}),
                "evidence": seen,
            }
            for rule, seen in zip(ruleset["rules"], evidence["rules"], strict=False)
        ]
        shown.append({"name": ruleset["name"], "scope": ruleset["scope"], "rules": rules})
    return shown


def draft_text(proposal: dict) -> str:
    """What "Save as ruleset" writes, as the operator edits it: the groups to create, then the rulesets."""
    return json.dumps(
        {"address_groups": proposal["address_groups"], "rulesets": proposal["rulesets"]}, indent=2
    )


def _save(api, text: str) -> dict:
    """Create the draft's address groups, then its rulesets; stop at the first refusal and say which
    object it was. A group that exists already with exactly these members is reused, so that saving
    again after fixing a refused ruleset does not trip over the groups the first attempt created."""
    try:
        draft = json.loads(text)
    except ValueError as error:
        return {"draft_error": f"The draft is not JSON: {error}."}
    if not isinstance(draft, dict) or not isinstance(draft.get("rulesets"), list):
        return {"draft_error": "The draft must be an object with a list of rulesets (and of address_groups)."}
    groups = draft.get("address_groups") or []
    if not isinstance(groups, list):
        return {"draft_error": "address_groups must be a list."}
    stored = api.get("/address-groups")
    existing = {g["name"]: g["members"] for g in stored.data["address_groups"]} if stored.ok else {}
    created: list[dict] = []
    for group in groups:
        name = group.get("name") if isinstance(group, dict) else None
        if name in existing and isinstance(group, dict) and existing[name] == group.get("members"):
            continue
        result = api.post("/address-groups", group)
        if not result.ok:
            return {
                "created": created,
                "failed": {"what": f"address group “{name}”", "problem": result.problem},
            }
        created.append({"kind": "address group", "name": result.data["name"], "href": f"/policy/address-groups/{result.data['id']}"})  # fmt: skip
    for ruleset in draft["rulesets"]:
        name = ruleset.get("name") if isinstance(ruleset, dict) else None
        result = api.post("/rulesets", ruleset)
        if not result.ok:
            return {"created": created, "failed": {"what": f"ruleset “{name}”", "problem": result.problem}}
        created.append({"kind": "ruleset", "name": result.data["name"], "href": f"/policy/rulesets/{result.data['id']}"})  # fmt: skip
    return {"created": created, "saved": True}


def _simulation_link(form: dict) -> str:
    query = {"labels": form["labels"], "workloads": form["workloads"], "mode": "simulation"}
    return "/mode-changes?" + urlencode({k: v for k, v in query.items() if v})


@require_http_methods(["GET", "POST"])
@operator_page
def suggest(request, api):
    """GET: the form. POST `suggest`: the proposal. POST `save`: the edited draft, saved."""
    params = request.POST if request.method == "POST" else request.GET
    form = {
        **selection_form(params),
        "label_keys": params.get("label_keys", "app"),
        "aggregate_prefix": params.get("aggregate_prefix", ""),
        "aggregate_prefix_v6": params.get("aggregate_prefix_v6", ""),
    }
    chosen = any(params.get(key) for key in ("range", "from", "to"))
    span = chosen_range(params if chosen else {"range": SUGGEST_RANGE})
    context: dict = {"form": form, "span": span, "ranges": list(RANGES), "simulation": _simulation_link(form)}
    status = 200
    action = params.get("action")
    if request.method == "POST" and action == "save":
        context["draft"] = params.get("draft", "")
        context.update(_save(api, context["draft"]))
        status = 200 if context.get("saved") else 422
    elif request.method == "POST":
        result = api.post("/policies/suggestions", _request_body(form, span))
        if result.ok:
            context.update(
                proposal=result.data, proposed=_proposed(result.data), draft=draft_text(result.data)
            )
        else:
            status = result.status
            context.update(problem=result.problem, errors=result.findings_by_field())
    return page(
        request, "console/suggest.html", context, partial="console/partials/suggest_body.html", status=status
    )

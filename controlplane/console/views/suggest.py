"""Suggest rules: the API's proposal learnt from the stored flows (POST /policies/suggestions), read
with its evidence and coverage by host name, rules kept or dropped with checkboxes and rulesets
renamed in place (JSON only in an advanced view), then saved in one request (POST /policies/drafts:
all or nothing), and a link to put the workloads in `simulation`. The direction chosen says whose
connections are learnt from: those the workloads receive (inbound rulesets) or open (outbound ones, whose
rules name `destinations`; the link then moves the outbound mode)."""

from __future__ import annotations

import json
from collections import defaultdict
from urllib.parse import urlencode

from django.views.decorators.http import require_http_methods

from controlplane.console import policy_forms as forms
from controlplane.console.pages import RANGES, chosen_range, operator_page, page
from controlplane.console.views.evidence import selection_form, selection_query

SUGGEST_RANGE = "7d"  # a week holds the weekly jobs a day would miss
NOISE_KINDS = (
    ("scanner", "scanner-like peers"),
    ("ephemeral-port", "connections to ephemeral local ports"),
    ("lookalike-label", "lookalike label values"),
)


def _request_body(form: dict, span: dict) -> dict:
    body: dict = {**selection_query(form), "from": span["from"], "to": span["to"]}
    if form["direction"] != "inbound":
        # Typed or forged, it goes as it is: the API's finding names the field.
        body["direction"] = form["direction"]
    keys = [k.strip() for k in form["label_keys"].replace(",", " ").split() if k.strip()]
    if keys:
        body["label_keys"] = keys
    if form["include_noise"]:
        body["include_noise"] = form["include_noise"]
    peers = [p.strip() for p in form["exclude_peers"].replace(",", " ").split() if p.strip()]
    if peers:
        body["exclude_peers"] = peers
    for name in ("aggregate_prefix", "aggregate_prefix_v6"):
        text = form[name].strip()
        if text:
            # Typed text that is not a number goes as it is: the API's finding names the field.
            body[name] = int(text) if text.isdigit() else text
    return body


def _peers_shown(peers: list[dict], hostnames: dict) -> list[dict]:
    return [{**p, "name": hostnames.get(p["peer_workload_id"] or "", p["peer"])} for p in peers]


def _proposed(proposal: dict, kept: set | None = None, findings: dict | None = None) -> list[dict]:
    """Each proposed ruleset with its rules beside their evidence (the answer lists both in the same
    order), sources and services written as the rule form writes them, peers by host name; `kept`
    the rules ticked (None: all), `findings` a refused save's, by (ruleset, rule) index."""
    hostnames, findings = proposal.get("hostnames", {}), findings or {}
    shown = []
    for r, (ruleset, evidence) in enumerate(zip(proposal["rulesets"], proposal["evidence"], strict=False)):
        rules = [
            {
                "key": f"{r}.{i}",
                "kept": kept is None or f"{r}.{i}" in kept,
                "sources_text": forms.sources_text(_peers_of(rule), {}),
                "services_text": forms.rule_services_text(rule["services"], {}),
                "evidence": seen,
                "peers": _peers_shown(seen["peers"], hostnames),
                "findings": findings.get((r, i), []),
            }
            for i, (rule, seen) in enumerate(zip(ruleset["rules"], evidence["rules"], strict=False))
        ]
        hosts = sorted(hostnames.get(w, w) for w in evidence["workloads"])
        shown.append(
            {"index": r, "name": ruleset["name"], "scope": ruleset["scope"], "rules": rules, "hosts": hosts,
             "findings": findings.get((r, None), []), "outbound": ruleset.get("direction") == "outbound"}
        )  # fmt: skip
    return shown


def _peers_of(rule: dict) -> list[dict]:
    """A proposed rule's peers: its sources (inbound) or destinations (outbound)."""
    return rule.get("sources", rule.get("destinations", []))


def draft_text(proposal: dict) -> str:
    """The draft as the advanced view shows it: the groups to create, then the rulesets."""
    return json.dumps(
        {"address_groups": proposal["address_groups"], "rulesets": proposal["rulesets"]}, indent=2
    )


def _kept_draft(proposal: dict, kept: set[str], names: dict[int, str]) -> tuple[dict, list[tuple]]:
    """The draft of the ticked rules (rulesets left without a rule dropped, and the groups no kept
    rule names), with each saved rule's place in the proposal, by its place in the draft."""
    rulesets, places = [], []
    for r, ruleset in enumerate(proposal["rulesets"]):
        rules = [(i, rule) for i, rule in enumerate(ruleset["rules"]) if f"{r}.{i}" in kept]
        if not rules:
            continue
        places.append((r, [i for i, _ in rules]))
        rulesets.append({**ruleset, "name": names.get(r) or ruleset["name"], "rules": [x for _, x in rules]})
    named = {
        s["address_group"]
        for rs in rulesets
        for rule in rs["rules"]
        for s in _peers_of(rule)
        if "address_group" in s
    }
    groups = [g for g in proposal["address_groups"] if g["name"] in named]
    return {"address_groups": groups, "rulesets": rulesets}, places


def _at_rules(errors: list[dict], places: list[tuple]) -> tuple[dict, list[dict]]:
    """A refused save's findings by (ruleset, rule) of the proposal; those of no rule apart."""
    found: dict = defaultdict(list)
    elsewhere = []
    for finding in errors:
        parts = finding.get("path", "").split("/")
        if len(parts) > 2 and parts[1] == "rulesets" and parts[2].isdigit() and int(parts[2]) < len(places):
            r, rules = places[int(parts[2])]
            if len(parts) > 4 and parts[3] == "rules" and parts[4].isdigit() and int(parts[4]) < len(rules):
                found[(r, rules[int(parts[4])])].append(finding)
            else:
                found[(r, None)].append(finding)
        else:
            elsewhere.append(finding)
    return dict(found), elsewhere


def _created(saved: dict) -> list[dict]:
    return [
        {"kind": "address group", "name": g["name"], "href": f"/policy/address-groups/{g['id']}"}
        for g in saved["address_groups"]
    ] + [
        {"kind": "ruleset", "name": r["name"], "href": f"/policy/rulesets/{r['id']}"}
        for r in saved["rulesets"]
    ]


def _save(api, params) -> dict:
    """Save the ticked rules (or, in the advanced view, the edited JSON) in one request: the API
    creates every object or none. Refused, the proposal and its evidence stay on the page with each
    finding at its rule."""
    try:
        proposal = json.loads(params.get("proposal", ""))
    except ValueError:
        proposal = None
    text = params.get("draft", "")
    edited = proposal is None or text.strip() != draft_text(proposal).strip()
    context: dict = {"draft": text}
    places: list[tuple] = []
    if edited:
        try:
            body = json.loads(text)
        except ValueError as error:
            return {**context, "draft_error": f"The draft is not JSON: {error}.", "advanced": True}
    else:
        kept = set(params.getlist("keep"))
        names = {
            int(k[5:]): v.strip() for k, v in params.items() if k.startswith("name-") and k[5:].isdigit()
        }
        body, places = _kept_draft(proposal, kept, names)
        if not body["rulesets"]:
            return {**_shown(proposal, kept), "draft_error": "No rule is ticked: nothing to save."}
    result = api.post("/policies/drafts", body)
    if result.ok:
        return {"created": _created(result.data), "saved": True}
    failed = {"what": "the draft", "problem": result.problem}
    if edited:
        return {**context, "failed": failed, "advanced": True}
    at_rules, elsewhere = _at_rules(result.problem.get("errors") or [], places)
    return {
        **_shown(proposal, set(params.getlist("keep")), at_rules),
        "failed": failed,
        "elsewhere": elsewhere,
    }


def _shown(proposal: dict, kept: set | None = None, findings: dict | None = None) -> dict:
    return {
        "proposal": proposal,
        "proposed": _proposed(proposal, kept, findings),
        "draft": draft_text(proposal),
        "proposal_json": json.dumps(proposal),
    }


def _simulation_link(form: dict) -> str:
    query = {"labels": form["labels"], "workloads": form["workloads"], "mode": "simulation"}
    if form["direction"] == "outbound":
        query["direction"] = "outbound"
    return "/mode-changes?" + urlencode({k: v for k, v in query.items() if v})


@require_http_methods(["GET", "POST"])
@operator_page
def suggest(request, api):
    """GET: the form. POST `suggest`: the proposal. POST `save`: the edited draft, saved."""
    params = request.POST if request.method == "POST" else request.GET
    form = {
        **selection_form(params),
        "label_keys": params.get("label_keys", ""),
        "include_noise": params.getlist("include_noise") if hasattr(params, "getlist") else [],
        "exclude_peers": params.get("exclude_peers", ""),
        "aggregate_prefix": params.get("aggregate_prefix", ""),
        "aggregate_prefix_v6": params.get("aggregate_prefix_v6", ""),
        "direction": params.get("direction") or "inbound",
    }
    chosen = any(params.get(key) for key in ("range", "from", "to"))
    span = chosen_range(params if chosen else {"range": SUGGEST_RANGE})
    context: dict = {
        "form": form, "span": span, "ranges": list(RANGES), "simulation": _simulation_link(form),
        "noise_kinds": NOISE_KINDS,
    }  # fmt: skip
    status = 200
    action = params.get("action")
    if request.method == "POST" and action == "save":
        context.update(_save(api, params))
        status = 200 if context.get("saved") else 422
    elif request.method == "POST":
        result = api.post("/policies/suggestions", _request_body(form, span))
        if result.ok:
            context.update(_shown(result.data))
        else:
            status = result.status
            context.update(problem=result.problem, errors=result.findings_by_field())
    return page(
        request, "console/suggest.html", context, partial="console/partials/suggest_body.html", status=status
    )

"""Policy pages: rulesets and their rules, services, address groups; selector preview and the render
dry-run. Every read and write is the operator API's."""

from __future__ import annotations

from django.views.decorators.http import require_GET, require_http_methods, require_POST

from controlplane.console import policy_forms as forms
from controlplane.console.confirm import Confirmation, ask, confirmed, scope_reach
from controlplane.console.impact import impact_span, impact_words, with_hostnames
from controlplane.console.pages import RANGES, go, lines, operator_page, page
from controlplane.console.views.fleet import not_found


def _names(api, path: str, key: str) -> dict[str, str]:
    result = api.get(path)
    return {item["id"]: item["name"] for item in result.data[key]} if result.ok else {}


@require_GET
@operator_page
def policy_index(request, api):
    rulesets = api.get("/rulesets").data
    return page(
        request,
        "console/policy.html",
        {
            "rulesets": rulesets["rulesets"],
            "policy_version": rulesets.get("policy_version"),
            "services": api.get("/services").data["services"],
            "address_groups": api.get("/address-groups").data["address_groups"],
        },
    )


def _ruleset_form(form) -> dict:
    return {
        "name": form.get("name", ""),
        "description": form.get("description", ""),
        "scope": form.get("scope", ""),
        "direction": "outbound" if form.get("direction") == "outbound" else "inbound",
        "enabled": form.get("enabled") == "on",
    }


@require_http_methods(["GET", "POST"])
@operator_page
def ruleset_new(request, api):
    context: dict = {"form": {"enabled": True}, "creating": True}
    if request.method == "POST":
        body = {**_ruleset_form(request.POST), "rules": []}
        result = api.post("/rulesets", body)
        if result.ok:
            return go(request, f"/policy/rulesets/{result.data['id']}")
        context.update(form=body, problem=result.problem, errors=result.findings_by_field())
    return page(request, "console/ruleset.html", context, status=422 if "problem" in context else 200)


def _rule_rows(ruleset: dict, services: dict, groups: dict, service_entries: dict) -> list[dict]:
    return [
        {
            **rule,
            "sources_text": forms.sources_text(forms.peers(rule), groups),
            "services_text": forms.rule_services_text(rule["services"], services),
            "refuses_everything": forms.refuses_everything(rule, service_entries),
        }
        for rule in ruleset["rules"]
    ]


def _service_entries(api) -> dict[str, list[dict]]:
    result = api.get("/services")
    return {item["id"]: item["entries"] for item in result.data["services"]} if result.ok else {}


@require_http_methods(["GET", "POST"])
@operator_page
def ruleset_detail(request, api, ruleset_id: str):
    found = api.get(f"/rulesets/{ruleset_id}")
    if not found.ok:
        return not_found(request, f"ruleset {ruleset_id}")
    ruleset = found.data
    span = impact_span(request.POST if request.method == "POST" else request.GET)
    context: dict = {"ruleset": ruleset, "form": ruleset, "version": ruleset["version"], "impact_span": span,
                     "ranges": list(RANGES)}  # fmt: skip
    status = 200
    if request.method == "POST" and request.POST.get("action") == "impact":
        edited = {**_ruleset_form(request.POST), "rules": ruleset["rules"]}
        context.update(form=edited, version=request.POST.get("version", ""))
        result = _ruleset_impact(api, ruleset, edited, span)
        if result.ok:
            context.update(
                impact=with_hostnames(api, result.data), impact_words=impact_words(result.data, span)
            )
        else:
            status = result.status
            context.update(problem=result.problem, errors=_ruleset_errors(result))
    elif request.method == "POST":
        # The rules go back as they are now; If-Match carries the version the form was opened at, so a
        # rule changed meanwhile makes the save a 412 rather than a silent overwrite.
        body = {**_ruleset_form(request.POST), "rules": ruleset["rules"]}
        version = request.POST.get("version", "")
        result = api.put(f"/rulesets/{ruleset_id}", body, if_match=version)
        if result.ok:
            context.update(ruleset=result.data, form=result.data, version=result.data["version"], saved=True)
        else:
            status = result.status
            context.update(
                form=body, version=version, problem=result.problem, errors=result.findings_by_field()
            )
    services, groups = _names(api, "/services", "services"), _names(api, "/address-groups", "address_groups")
    context["rules"] = _rule_rows(context["ruleset"], services, groups, _service_entries(api))
    context["rule_form"] = {}
    return page(request, "console/ruleset.html", context, status=status)


def _ruleset_errors(result) -> dict:
    """An impact's findings point into the whole set (`/rulesets/2/scope`, `/address_groups/0/members/1`):
    next to the form's field."""
    errors: dict[str, list[str]] = {}
    for finding in (result.problem or {}).get("errors") or []:
        steps = str(finding.get("path", "")).strip("/").split("/")
        whole_set = steps[0] in ("rulesets", "services", "address_groups") and len(steps) >= 3
        field = steps[2] if whole_set else steps[0]
        errors.setdefault(field, []).append(str(finding.get("message", "")))
    return errors


def _ruleset_impact(api, stored: dict, edited: dict, span: dict):
    """The impact of the ruleset form's edit over past traffic. The same scope: its workloads; a
    changed scope reaches workloads of both, which one selection cannot name: the whole fleet."""
    rulesets = [
        ({**r, **edited, "id": r["id"]} if r["id"] == stored["id"] else r)
        for r in api.get("/rulesets").data["rulesets"]
    ]
    same = edited["scope"].strip() == stored["scope"] and stored["scope"]
    body = {
        "rulesets": rulesets,
        "label": [stored["scope"]] if same else [],
        "from": span["from"],
        "to": span["to"],
        # An outbound ruleset's edit changes what its workloads may open: judged on that evidence.
        **({"direction": "outbound"} if stored.get("direction") == "outbound" else {}),
    }
    return api.post("/policies/impact", body)


@require_http_methods(["GET", "POST"])
@operator_page
def ruleset_delete(request, api, ruleset_id: str):
    if not confirmed(request):
        found = api.get(f"/rulesets/{ruleset_id}")
        if not found.ok:
            return not_found(request, f"ruleset {ruleset_id}")
        ruleset = found.data
        reach, consequences = scope_reach(api, ruleset)
        rules = len(ruleset["rules"])
        return ask(
            request,
            Confirmation(
                title=f"Delete ruleset {ruleset['name']}",
                summary=f"Delete ruleset “{ruleset['name']}”: its {rules} rule{'s' if rules != 1 else ''} "
                f"go, and {reach}.",
                consequences=consequences,
                action=f"/policy/rulesets/{ruleset_id}/delete",
                cancel=f"/policy/rulesets/{ruleset_id}",
                button="Delete the ruleset and its rules",
                fields={"version": ruleset["version"]},
            ),
        )
    result = api.delete(f"/rulesets/{ruleset_id}", if_match=request.POST.get("version", ""))
    if result.ok:
        return go(request, "/policy")
    return page(
        request,
        "console/refused.html",
        {"problem": result.problem, "back": f"/policy/rulesets/{ruleset_id}"},
        status=result.status,
    )


def _dryrun_rulesets(api, ruleset_id: str, rule_id: str | None, rule: dict) -> list[dict]:
    """Every stored ruleset, with this rule as the form has it (added, or in place of the stored one)."""
    rulesets = api.get("/rulesets").data["rulesets"]
    for ruleset in rulesets:
        if ruleset["id"] != ruleset_id:
            continue
        if rule_id is None:
            ruleset["rules"].append(rule)
        else:
            ruleset["rules"] = [
                ({**rule, "id": rule_id} if r["id"] == rule_id else r) for r in ruleset["rules"]
            ]
    return rulesets


@require_http_methods(["GET", "POST"])
@operator_page
def rule_edit(request, api, ruleset_id: str, rule_id: str | None = None):
    """Add a rule (rule_id None) or edit one; the `dryrun` button renders the fleet under the form's
    rule and shows what would change, `impact` what the change would have done to the stored traffic
    of a past range; both save nothing."""
    found = api.get(f"/rulesets/{ruleset_id}")
    if not found.ok:
        return not_found(request, f"ruleset {ruleset_id}")
    services, groups = _names(api, "/services", "services"), _names(api, "/address-groups", "address_groups")
    span = impact_span(request.POST if request.method == "POST" else request.GET)
    context: dict = {"ruleset": found.data, "rule_id": rule_id, "impact_span": span, "ranges": list(RANGES)}
    status = 200
    if request.method == "GET":
        if rule_id is None:
            context["rule_form"] = {}
        else:
            rule = api.get(f"/rulesets/{ruleset_id}/rules/{rule_id}")
            if not rule.ok:
                return not_found(request, f"rule {rule_id}")
            context["rule_form"] = {
                "description": rule.data["description"],
                "rule_action": rule.data["action"],
                "sources": forms.sources_text(forms.peers(rule.data), groups),
                "services": forms.rule_services_text(rule.data["services"], services),
                "version": rule.data["version"],
            }
        return page(request, "console/rule.html", context)

    body = forms.rule_body(request.POST, found.data.get("direction", "inbound"))
    context["rule_form"] = {
        key: request.POST.get(key, "")
        for key in ("description", "rule_action", "sources", "services", "version")
    }
    if request.POST.get("action") == "dryrun":
        result = api.post(
            "/policies/render-dryrun", {"rulesets": _dryrun_rulesets(api, ruleset_id, rule_id, body)}
        )
        if result.ok:
            context["dryrun"] = _with_hostnames(api, result.data)
    elif request.POST.get("action") == "impact":
        # A rule reaches only the workloads of its ruleset's scope: the impact (and its coverage) is
        # theirs, not the whole fleet's.
        scope = found.data["scope"]
        draft = {
            "rulesets": _dryrun_rulesets(api, ruleset_id, rule_id, body),
            "label": [scope] if scope else [],
            **({"direction": "outbound"} if found.data.get("direction") == "outbound" else {}),
        }
        result = api.post("/policies/impact", {**draft, "from": span["from"], "to": span["to"]})
        if result.ok:
            context.update(
                impact=with_hostnames(api, result.data), impact_words=impact_words(result.data, span)
            )
    elif rule_id is None:
        result = api.post(f"/rulesets/{ruleset_id}/rules", body)
    else:
        result = api.put(
            f"/rulesets/{ruleset_id}/rules/{rule_id}", body, if_match=request.POST.get("version", "")
        )
    if result.ok and request.POST.get("action") not in ("dryrun", "impact"):
        return go(request, f"/policy/rulesets/{ruleset_id}")
    if not result.ok:
        status = result.status
        context.update(problem=result.problem, errors=_rule_errors(result))
    return page(
        request, "console/rule.html", context, partial="console/partials/rule_form.html", status=status
    )


def _with_hostnames(api, dryrun: dict) -> dict:
    """The dry-run names workloads by id; a person reads host names (of exactly those workloads)."""
    ids = [change["workload_id"] for change in dryrun["changed"]]
    fleet = api.get_all("/workloads", params={"id": ids}) if ids else None
    names = {w["id"]: w["hostname"] for w in fleet.data["items"]} if fleet and fleet.ok else {}
    for change in dryrun["changed"]:
        change["hostname"] = names.get(change["workload_id"], change["workload_id"])
    return dryrun


def _rule_errors(result) -> dict:
    """A dry-run's findings point into the whole hypothetical set (`/rulesets/2/rules/0/sources/1`); a
    rule's into the rule (`/sources/1`): both land next to the rule's field."""
    errors: dict[str, list[str]] = {}
    for finding in (result.problem or {}).get("errors") or []:
        steps = str(finding.get("path", "")).strip("/").split("/")
        if steps[:1] == ["rulesets"] and len(steps) >= 4:
            steps = steps[4:]
        errors.setdefault(steps[0] if steps else "", []).append(str(finding.get("message", "")))
    return errors


@require_http_methods(["GET", "POST"])
@operator_page
def rule_delete(request, api, ruleset_id: str, rule_id: str):
    if not confirmed(request):
        found, rule = api.get(f"/rulesets/{ruleset_id}"), api.get(f"/rulesets/{ruleset_id}/rules/{rule_id}")
        if not (found.ok and rule.ok):
            return not_found(request, f"rule {rule_id} of ruleset {ruleset_id}")
        services, groups = (
            _names(api, "/services", "services"),
            _names(api, "/address-groups", "address_groups"),
        )
        sources = "; ".join(forms.sources_text(forms.peers(rule.data), groups).splitlines())
        ports = "; ".join(forms.rule_services_text(rule.data["services"], services).splitlines())
        described = f" ({rule.data['description']})" if rule.data.get("description") else ""
        verb = "refuses" if rule.data.get("action") == "deny" else "admits"
        reach, consequences = scope_reach(api, found.data)
        return ask(
            request,
            Confirmation(
                title=f"Delete rule {rule.data['number']} of {found.data['name']}",
                summary=f"Delete rule {rule.data['number']}{described} of ruleset “{found.data['name']}”, which "
                f"{verb} {sources or 'nothing'} to {ports or 'nothing'}; the ruleset {reach}.",
                consequences=consequences,
                action=f"/policy/rulesets/{ruleset_id}/rules/{rule_id}/delete",
                cancel=f"/policy/rulesets/{ruleset_id}",
                button="Delete the rule",
                fields={"version": rule.data["version"]},
            ),
        )
    result = api.delete(f"/rulesets/{ruleset_id}/rules/{rule_id}", if_match=request.POST.get("version", ""))
    if result.ok:
        return go(request, f"/policy/rulesets/{ruleset_id}")
    return page(
        request,
        "console/refused.html",
        {"problem": result.problem, "back": f"/policy/rulesets/{ruleset_id}"},
        status=result.status,
    )


# Services and address groups: a name and one list, edited as lines of text.
NAMED = {
    "services": {"title": "Service", "api": "/services", "field": "entries", "to_json": forms.entries_from_text,
                 "to_text": lambda items: "\n".join(forms.entry_text(e) for e in items),
                 "help": "One per line: tcp/443, tcp/8000-8080, udp/53, icmp, icmpv6."},
    "address-groups": {"title": "Address group", "api": "/address-groups", "field": "members", "to_json": lines,
                       "to_text": lambda items: "\n".join(items),
                       "help": "One address or CIDR per line: 10.1.0.0/16, 192.0.2.7, 2001:db8::/48."},
}  # fmt: skip


@require_http_methods(["GET", "POST"])
@operator_page
def named_edit(request, api, kind: str, object_id: str | None = None):
    spec = NAMED[kind]
    context: dict = {"kind": kind, "spec": spec, "object_id": object_id, "form": {"name": "", "text": ""}}
    if object_id is not None:
        found = api.get(f"{spec['api']}/{object_id}")
        if not found.ok:
            return not_found(request, f"{spec['title'].lower()} {object_id}")
        context["form"] = {"name": found.data["name"], "text": spec["to_text"](found.data[spec["field"]]),
                           "version": found.data["version"]}  # fmt: skip
    context.update(impact_span=impact_span(request.POST or request.GET), ranges=list(RANGES))
    if request.method == "GET":
        return page(request, "console/named.html", context)
    body = {
        "name": request.POST.get("name", ""),
        spec["field"]: spec["to_json"](request.POST.get("text", "")),
    }
    version = request.POST.get("version", "")
    stored_name = context["form"]["name"]
    context["form"] = {"name": body["name"], "text": request.POST.get("text", ""), "version": version}
    if object_id is not None and request.POST.get("action") == "impact":
        # The hypothetical set replaces a service or group by name: the stored name, since a rename
        # changes no traffic and the rules name the stored one.
        key = "services" if kind == "services" else "address_groups"
        span = context["impact_span"]
        draft = {"rulesets": api.get("/rulesets").data["rulesets"], key: [{**body, "name": stored_name}]}
        result = api.post("/policies/impact", {**draft, "from": span["from"], "to": span["to"]})
        if result.ok:
            context.update(
                impact=with_hostnames(api, result.data), impact_words=impact_words(result.data, span)
            )
            return page(request, "console/named.html", context)
        errors = _ruleset_errors(result)
        context.update(problem=result.problem, errors={"text": errors.pop(spec["field"], []), **errors})
        return page(request, "console/named.html", context, status=result.status)
    if object_id is None:
        result = api.post(spec["api"], body)
    else:
        result = api.put(f"{spec['api']}/{object_id}", body, if_match=version)
    if result.ok:
        return go(request, "/policy")
    errors = result.findings_by_field()
    context.update(problem=result.problem, errors={"text": errors.pop(spec["field"], []), **errors})
    return page(request, "console/named.html", context, status=result.status)


@require_http_methods(["GET", "POST"])
@operator_page
def named_delete(request, api, kind: str, object_id: str):
    spec = NAMED[kind]
    if not confirmed(request):
        found = api.get(f"{spec['api']}/{object_id}")
        if not found.ok:
            return not_found(request, f"{spec['title'].lower()} {object_id}")
        what = f"{spec['title'].lower()} {found.data['name']}"
        listed = ", ".join(spec["to_text"](found.data[spec["field"]]).splitlines()) or "empty"
        return ask(
            request,
            Confirmation(
                title=f"Delete {what}",
                summary=f"Delete {spec['title'].lower()} “{found.data['name']}” ({listed}).",
                consequences=["While a rule still uses it, the deletion is refused and the rules are named."],
                action=f"/policy/{kind}/{object_id}/delete",
                cancel=f"/policy/{kind}/{object_id}",
                button=f"Delete the {spec['title'].lower()}",
                fields={"version": found.data["version"]},
            ),
        )
    result = api.delete(f"{spec['api']}/{object_id}", if_match=request.POST.get("version", ""))
    if result.ok:
        return go(request, "/policy")
    return page(
        request, "console/refused.html", {"problem": result.problem, "back": "/policy"}, status=result.status
    )


@require_POST
@operator_page
def selector_preview(request, api):
    selector = request.POST.get("scope", "")
    if "sources" in request.POST:  # a rule's sources: preview the selector line typed last
        selectors = [
            s["selector"] for s in forms.sources_from_text(request.POST["sources"]) if "selector" in s
        ]
        selector = selectors[-1] if selectors else ""
    result = api.post("/selectors/preview", {"selector": selector})
    return page(
        request,
        "console/partials/selector_preview.html",
        {"preview": result.data if result.ok else None, "problem": result.problem, "selector": selector},
    )

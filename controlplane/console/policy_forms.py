"""The policy forms' text fields, one item per line, to and from the API's JSON.

A rule's sources: `any`, `group:NAME` (an address group) or a label selector. Its services and a
service's entries: `tcp/443`, `tcp/8000-8080`, `udp/53`, `icmp`, `icmpv6`, or (for a rule) the name of
a service. Lines are turned into JSON as written; deciding what is valid is the API's job, and its
findings are shown next to the field they name."""

from __future__ import annotations

import re

from controlplane.console.pages import lines
from controlplane.validation import is_digits

INLINE = re.compile(
    r"^(?P<protocol>tcp|udp)/(?P<port>[^-]+)(?:-(?P<port_to>.+))?$|^(?P<bare>icmp|icmpv6)$", re.I
)


def _number(text: str):
    return int(text) if is_digits(text.strip()) else text.strip()


def entry_from_line(line: str) -> dict | None:
    match = INLINE.match(line)
    if not match:
        return None
    if match["bare"]:
        return {"protocol": match["bare"].lower()}
    entry = {"protocol": match["protocol"].lower(), "port": _number(match["port"])}
    if match["port_to"]:
        entry["port_to"] = _number(match["port_to"])
    return entry


def entry_text(entry: dict) -> str:
    if "port" not in entry or entry.get("port") is None:
        return entry["protocol"]
    if entry.get("port_to") not in (None, entry["port"]):
        return f"{entry['protocol']}/{entry['port']}-{entry['port_to']}"
    return f"{entry['protocol']}/{entry['port']}"


def entries_from_text(text: str) -> list:
    # A line that is no entry at all goes to the API as written, so its finding names it.
    return [entry_from_line(line) or line for line in lines(text)]


def sources_from_text(text: str) -> list[dict]:
    sources = []
    for line in lines(text):
        if line.lower() == "any":
            sources.append({"any": True})
        elif line.lower().startswith("group:"):
            sources.append({"address_group": line.split(":", 1)[1].strip()})
        else:
            sources.append({"selector": line})
    return sources


def rule_services_from_text(text: str) -> list[dict]:
    return [entry_from_line(line) or {"service": line} for line in lines(text)]


def sources_text(sources: list[dict], group_names: dict[str, str]) -> str:
    out = []
    for source in sources:
        if source.get("any"):
            out.append("any")
        elif "address_group" in source:
            out.append(f"group:{group_names.get(source['address_group'], source['address_group'])}")
        else:
            out.append(source.get("selector", ""))
    return "\n".join(out)


def rule_services_text(services: list[dict], service_names: dict[str, str]) -> str:
    return "\n".join(
        service_names.get(item["service"], item["service"]) if "service" in item else entry_text(item)
        for item in services
    )


def peers(rule: dict) -> list[dict]:
    """A rule's sources, or its destinations in an outbound ruleset: the form's one `sources` field."""
    return rule.get("sources", rule.get("destinations", []))


def rule_body(form, direction: str = "inbound") -> dict:
    # The field is `rule_action`: the form's buttons already submit `action` (dryrun, impact, save).
    return {
        "description": form.get("description", ""),
        "action": form.get("rule_action") or "allow",
        ("destinations" if direction == "outbound" else "sources"): sources_from_text(
            form.get("sources", "")
        ),
        "services": rule_services_from_text(form.get("services", "")),
    }


def refuses_everything(rule: dict, service_entries: dict[str, list[dict]]) -> bool:
    """A deny rule from `any` source on every service (named services resolved by id to their entries):
    the ruleset's page warns of it, as the dry-run does (policy.render_inputs.refuses_everything; the
    console reads the API's JSON, not the renderer's inputs)."""
    if rule.get("action") != "deny" or not any(s.get("any") for s in peers(rule)):
        return False
    ranges: dict[str, list[tuple[int, int]]] = {"tcp": [], "udp": [], "icmp": [], "icmpv6": []}
    for item in rule["services"]:
        for entry in service_entries.get(item["service"], []) if "service" in item else [item]:
            port = entry.get("port") or 0
            ranges.setdefault(entry["protocol"], []).append((port, entry.get("port_to") or port))
    if not (ranges["icmp"] and ranges["icmpv6"]):
        return False
    for protocol in ("tcp", "udp"):
        reached = 0  # every port up to here is covered
        for low, high in sorted(ranges[protocol]):
            if low > reached + 1:
                break
            reached = max(reached, high)
        if reached < 65535:
            return False
    return True

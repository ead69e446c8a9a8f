"""The impact of a policy edit over past traffic (POST /policies/impact), in the console's words:
"over the last 7 days this change would have refused 214 connections from 3 peers to 2 services"."""

from __future__ import annotations

from controlplane.console.chips import short_instant
from controlplane.console.pages import RANGES, chosen_range

DEFAULT_IMPACT_RANGE = "7d"
SPANS = {"1h": "the last hour", "6h": "the last 6 hours", "24h": "the last 24 hours", "7d": "the last 7 days"}


def impact_span(params) -> dict:
    """The range the impact is read over: `impact_range`, one of RANGES, the last 7 days unless chosen."""
    key = params.get("impact_range")
    return chosen_range({"range": key if key in RANGES else DEFAULT_IMPACT_RANGE})


def _counted(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def _what(summary: dict) -> str:
    return (
        f"{_counted(summary['connection_count'], 'connection', 'connections')} from "
        f"{_counted(summary['peer_count'], 'peer', 'peers')} to "
        f"{_counted(summary['service_count'], 'service', 'services')}"
    )


def impact_words(impact: dict, span: dict) -> dict:
    """The headline sentences, newly refused first; `period` names the range as people say it."""
    period = SPANS.get(span["key"]) or f"{short_instant(span['from'])} – {short_instant(span['to'])}"
    refused, admitted = impact["newly_refused_summary"], impact["newly_admitted_summary"]
    if not refused["count"] and not admitted["count"]:
        headline = (
            f"Over {period} this change would have refused and admitted exactly what the policy in force did."
        )
    else:
        parts = []
        if refused["count"]:
            parts.append(f"would have refused {_what(refused)}")
        if admitted["count"]:
            parts.append(f"would have admitted {_what(admitted)} that the policy in force refuses")
        headline = f"Over {period} this change " + ", and ".join(parts) + "."
    return {"period": period, "headline": headline}


def with_hostnames(api, impact: dict) -> dict:
    """The impact names workloads by id; a person reads host names (of exactly those listed)."""
    entries = impact["newly_refused"] + impact["newly_admitted"]
    ids = sorted(
        {e["workload_id"] for e in entries}
        | {e["peer_workload_id"] for e in entries if e["peer_workload_id"]}
    )
    fleet = api.get_all("/workloads", params={"id": ids}) if ids else None
    names = {w["id"]: w["hostname"] for w in fleet.data["items"]} if fleet and fleet.ok else {}
    for entry in entries:
        entry["hostname"] = names.get(entry["workload_id"], entry["workload_id"])
        entry["peer_hostname"] = names.get(entry["peer_workload_id"] or "", "")
    impact["newly_refused_groups"] = grouped(impact["newly_refused"])
    impact["newly_admitted_groups"] = grouped(impact["newly_admitted"])
    return impact


def _service(entry: dict) -> str:
    return (
        f"{entry['protocol']}/{entry['port']}" if entry["protocol"] in ("tcp", "udp") else entry["protocol"]
    )


def grouped(entries: list[dict]) -> list[dict]:
    """Impact keys by workload, then service, with totals; each service's peers by host name, most
    connections first: thousands of keys read as a few dozen lines, each expandable."""
    workloads: dict[str, dict] = {}
    for e in entries:
        w = workloads.setdefault(
            e["workload_id"],
            {"workload_id": e["workload_id"], "hostname": e["hostname"], "mode": e.get("mode", ""),
             "connection_count": 0, "peers": set(), "services": {}},
        )  # fmt: skip
        w["connection_count"] += e["connection_count"]
        w["peers"].add(e["peer"])
        service = w["services"].setdefault(
            _service(e), {"service": _service(e), "connection_count": 0, "peers": []}
        )
        service["connection_count"] += e["connection_count"]
        service["peers"].append(
            {"peer": e["peer"], "name": e.get("peer_hostname") or "", "connection_count": e["connection_count"],
             "rule_now": e.get("rule_now"), "rule_draft": e.get("rule_draft")}
        )  # fmt: skip
    out = []
    for w in sorted(workloads.values(), key=lambda w: -w["connection_count"]):
        services = sorted(w["services"].values(), key=lambda s: -s["connection_count"])
        for service in services:
            service["peers"].sort(key=lambda p: -p["connection_count"])
        out.append({**w, "peer_count": len(w["peers"]), "service_count": len(services), "services": services})
    return out


# What enforcing would refuse, asked of POST /policies/impact: the policy in force plus a ruleset that
# admits everything. A key that only the added ruleset admits is one no rule in force admits, which the
# impact lists as "newly admitted"; in `enforced` the table would refuse it.
ADMIT_EVERYTHING = {
    "name": "console: everything (comparison, never saved)",
    "description": "",
    "scope": "",
    "enabled": True,
    "rules": [
        {
            "description": "",
            "sources": [{"any": True}],
            "services": [
                {"protocol": "tcp", "port": 1, "port_to": 65535},
                {"protocol": "udp", "port": 1, "port_to": 65535},
                {"protocol": "icmp"},
                {"protocol": "icmpv6"},
            ],
        }
    ],
}


def refused_when_enforced(api, selection: dict, span: dict) -> tuple[dict | None, dict | None]:
    """The selection's keys of the range that no rule in force admits (the impact's answer, with the
    refused keys in `newly_admitted`), or the API's problem."""
    rulesets = api.get("/rulesets").data["rulesets"]
    body = {
        "rulesets": [*rulesets, ADMIT_EVERYTHING],
        "label": selection["label"],
        "workload": selection["workload"],
        "from": span["from"],
        "to": span["to"],
    }
    result = api.post("/policies/impact", body)
    if not result.ok:
        return None, result.problem
    return with_hostnames(api, result.data), None


def refused_words(impact: dict, span: dict) -> str:
    period = SPANS.get(span["key"]) or f"{short_instant(span['from'])} – {short_instant(span['to'])}"
    summary = impact["newly_admitted_summary"]
    if not summary["count"]:
        return f"Over {period} the policy in force admits every connection these workloads saw."
    return f"Over {period} the policy in force would have refused {_what(summary)} to these workloads once enforced."

"""Reads of stored flow evidence: one workload's windows, and the gaps of a set of workloads."""

from __future__ import annotations

import ipaddress
from datetime import datetime, timedelta

from django.db.models import Prefetch, Q

from controlplane.pagination import OrderKey, Page, list_fingerprint, paginate
from controlplane.problems import Finding, ValidationFailed
from controlplane.validation import parse_instant
from fleet.selectors import workload_get, workload_queryset
from flows.choices import Decision
from flows.models import EvidenceGap, FlowGroup, FlowWindow
from policy.grammar import Selector
from policy.models import Rule

MAX_RANGE = timedelta(days=31)
WINDOW_ORDER = (OrderKey("start"), OrderKey("id", read=lambda w: str(w.id)))
GAP_ORDER = (OrderKey("start"), OrderKey("id", read=lambda g: str(g.id)))


def flow_range_parse(*, start: str | None, end: str | None) -> tuple[datetime, datetime]:
    """`from` and `to`: RFC 3339 instants, `from` before `to`, at most 31 days apart."""
    findings = []
    parsed = {}
    for name, raw in (("from", start), ("to", end)):
        parsed[name] = parse_instant(raw) if raw else None
        if parsed[name] is None:
            findings.append(
                Finding(f"?{name}", "instant" if raw else "required", f"{name} is an RFC 3339 instant.")
            )
    if not findings and not parsed["from"] < parsed["to"]:
        findings.append(Finding("?to", "out-of-range", "to comes after from."))
    if not findings and parsed["to"] - parsed["from"] > MAX_RANGE:
        findings.append(Finding("?to", "out-of-range", f"A range spans at most {MAX_RANGE.days} days."))
    if findings:
        raise ValidationFailed(findings)
    return parsed["from"], parsed["to"]


def group_filters_parse(
    *, decision: str | None, peer: str | None, service: str | None, rule: str | None
) -> dict:
    """`decision`, `peer` (an address), `service` (`tcp/443`, `udp/53`, `icmp`) and `rule` (a lifetime
    rule number): each narrows the groups shown, and the windows to those with a matching group."""
    findings, filters = [], {}
    if decision:
        if decision not in Decision.values:
            findings.append(
                Finding("?decision", "decision", f"decision is one of {', '.join(Decision.values)}.")
            )
        filters["decision"] = decision
    if peer:
        try:
            filters["peer"] = ipaddress.ip_address(peer).compressed
        except ValueError:
            findings.append(Finding("?peer", "address", "peer is an IPv4 or IPv6 address."))
    if service:
        protocol, _, port = service.partition("/")
        if protocol not in ("tcp", "udp", "icmp", "icmpv6") or (
            port and not (port.isdigit() and int(port) <= 65535)
        ):
            findings.append(Finding("?service", "service", "service is tcp/PORT, udp/PORT, icmp or icmpv6."))
        filters["protocol"] = protocol
        if port.isdigit():
            filters["port"] = int(port)
    if rule:
        if not rule.isdigit():
            findings.append(Finding("?rule", "type", "rule is a rule number."))
        else:
            filters["rule_number"] = int(rule)
    if findings:
        raise ValidationFailed(findings)
    return filters


def flow_windows_list(
    *,
    workload_id: str,
    start: datetime,
    end: datetime,
    cursor: str | None,
    limit: int,
    groups: dict | None = None,
) -> Page:
    """One workload's stored windows that intersect [start, end), in time order, with their groups
    (only those matching `groups`, and only windows with one, when filters are given)."""
    if not workload_id:
        raise ValidationFailed(
            [Finding("?workload", "required", "workload is required: the id of one workload.")]
        )
    workload = workload_get(workload_id=workload_id, missing=f"No workload {workload_id}.")
    groups = groups or {}
    matching = FlowGroup.objects.filter(**groups)
    windows = FlowWindow.objects.filter(workload=workload, start__lt=end, end__gt=start)
    if groups:
        windows = windows.filter(id__in=matching.filter(workload=workload, start__lt=end).values("window_id"))
    windows = windows.prefetch_related(
        Prefetch("groups", queryset=matching.order_by("peer", "protocol", "port", "decision", "rule_number"))
    )
    fingerprint = list_fingerprint(
        "flows", {"workload": str(workload.id), "from": start.isoformat(), "to": end.isoformat(), **groups}
    )
    return paginate(windows, order=WINDOW_ORDER, cursor=cursor, limit=limit, fingerprint=fingerprint)


def evidence_gaps_list(
    *,
    workload_ids: list[str],
    labels: list[Selector],
    start: datetime,
    end: datetime,
    cursor: str | None,
    limit: int,
) -> Page:
    """The gaps of the selected workloads (ids and labels ANDed; none: the whole fleet) that
    intersect [start, end), in time order."""
    gaps = EvidenceGap.objects.filter(start__lt=end, end__gt=start)
    if workload_ids or labels:
        selected = workload_queryset(labels=labels)
        if workload_ids:
            selected = selected.filter(id__in=[workload_get(workload_id=w).id for w in workload_ids])
        gaps = gaps.filter(workload__in=selected.values("id"))
    fingerprint = list_fingerprint(
        "flows-gaps",
        {
            "workloads": sorted(workload_ids),
            "labels": sorted(str(s) for s in labels),
            "from": start.isoformat(),
            "to": end.isoformat(),
        },
    )
    return paginate(gaps, order=GAP_ORDER, cursor=cursor, limit=limit, fingerprint=fingerprint)


def rule_ids_by_number(numbers: set[int]) -> dict[int, str]:
    """The rules that hold these lifetime numbers now (a deleted rule's number names nothing)."""
    numbers.discard(None)  # type: ignore[arg-type]
    if not numbers:
        return {}
    return {
        number: str(rule_id)
        for number, rule_id in Rule.objects.filter(Q(number__in=numbers)).values_list("number", "id")
    }

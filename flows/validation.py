"""What the flow reads admit: the query parameters of GET /flows, /flows/gaps, /flows/rollup and
/flows/review (and the same options of `manage.py flows`), parsed with one finding per parameter to fix.
The reads themselves are flows/selectors.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from controlplane.problems import Finding, ValidationFailed
from controlplane.validation import is_digits, parse_instant
from flows.choices import AGGREGATE, Decision
from flows.reports import Refused, peer_address

MAX_RANGE = timedelta(days=31)
# No evidence lies outside these, and reading a range reaches a window's length before it and a few
# hours around it: near year 1 or 9999 that arithmetic leaves what a datetime can hold.
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9000, 1, 1, tzinfo=UTC)

# A rollup's `group_by` names and the key columns each groups by.
GROUP_KEYS = {
    "workload": ("workload_id",),
    "peer": ("peer",),
    "peer_workload": ("peer_workload_id",),
    "service": ("protocol", "port"),
    "decision": ("decision",),
    "rule": ("rule_number",),
    "ruleset": ("ruleset_id",),
    # The window's start: a time series (connections per window), what the console plots.
    "window": ("start",),
}


def flow_range_parse(*, start: str | None, end: str | None) -> tuple[datetime, datetime]:
    """`from` and `to`: RFC 3339 instants from 1970 to 9000, `from` before `to`, at most 31 days apart."""
    findings = []
    parsed = {}
    for name, raw in (("from", start), ("to", end)):
        parsed[name] = parse_instant(raw) if raw else None
        if parsed[name] is None:
            findings.append(
                Finding(f"?{name}", "instant" if raw else "required", f"{name} is an RFC 3339 instant.")
            )
    for name in ("from", "to"):
        if parsed[name] is not None and not EARLIEST <= parsed[name] <= LATEST:
            parsed[name] = None
            findings.append(Finding(f"?{name}", "out-of-range", f"{name} lies between 1970 and 9000."))
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
    """`decision`, `peer` (an address, or `*`: the aggregate keys), `service` (`tcp/443`, `udp/53`, `icmp`) and `rule` (a lifetime
    rule number): each narrows the groups shown, and the windows to those with a matching group."""
    findings, filters = [], {}
    if decision:
        if decision not in Decision.values:
            findings.append(
                Finding("?decision", "decision", f"decision is one of {', '.join(Decision.values)}.")
            )
        filters["decision"] = decision
    if peer == AGGREGATE:
        filters["peer"] = AGGREGATE  # the windows' aggregate keys (the keys over the bound, summed)
    elif peer:
        try:
            filters["peer"] = peer_address(peer[:64])
        except Refused as refused:
            findings.append(Finding("?peer", "address-zone" if "%" in peer else "address", f"{refused}."))
    if service:
        protocol, slash, port = service.partition("/")
        with_port = protocol in ("tcp", "udp") and bool(slash) and _port_number(port)
        if not (with_port or (protocol in ("icmp", "icmpv6") and not slash)):
            findings.append(
                Finding("?service", "service", "service is tcp/PORT, udp/PORT (1 to 65535), icmp or icmpv6.")
            )
        filters["protocol"] = protocol
        if with_port:
            filters["port"] = int(port)
    if rule:
        if not is_digits(rule):
            findings.append(Finding("?rule", "type", "rule is a rule number."))
        else:
            filters["rule_number"] = int(rule)
    if findings:
        raise ValidationFailed(findings)
    return filters


def workload_required(workload_id: str) -> str:
    if not workload_id:
        raise ValidationFailed(
            [Finding("?workload", "required", "workload is required: the id of one workload.")]
        )
    return workload_id


def _port_number(text: str) -> bool:
    """1 to 65535 as written: ASCII digits, no leading zero."""
    return is_digits(text) and text[0] != "0" and int(text) <= 65535


def group_by_parse(values: list[str]) -> list[str]:
    findings = [
        Finding(f"?group_by[{i}]", "group-by", f"group_by is one of {', '.join(GROUP_KEYS)}.")
        for i, value in enumerate(values)
        if value not in GROUP_KEYS
    ]
    if not values:
        findings.append(
            Finding("?group_by", "required", f"group_by is required: any of {', '.join(GROUP_KEYS)}.")
        )
    if findings:
        raise ValidationFailed(findings)
    return list(dict.fromkeys(values))

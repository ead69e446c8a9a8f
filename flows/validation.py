"""What the flow reads admit: the query parameters of GET /flows, /flows/gaps, /flows/rollup and
/flows/review (and the same options of `manage.py flows`), `direction` among them for every one, and the range, selection and label keys of
the reads of draft policy (POST /policies/impact and /policies/suggestions, and `manage.py policy`),
parsed with one finding per parameter to fix. The reads themselves are flows/selectors.py.

A range and a selection are parsed by one function, `flow_selection_parse`, wherever they are given:
the same input gets the same finding rule from every endpoint and command that takes it, at the path
of the parameter (`?from`, `?label[1]`) or of the body's member (`/from`, `/label/1`)."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from controlplane.problems import Finding, ValidationFailed
from controlplane.validation import is_digits, parse_instant
from fleet.selectors import label_filters_parse
from flows.choices import AGGREGATE, ANY_DIRECTION, READ_DIRECTIONS, Decision, Direction
from flows.reports import Refused, peer_address
from policy.grammar import GrammarError, Selector, validate_label_key

MAX_RANGE = timedelta(days=31)
# A selection's bounds. Selectors are ANDed, so more than a few say nothing new, and each is a clause
# of the workloads' query (64 of 64 requirements each is already 4,096 of them). Workload ids are
# deduplicated (by the UUID they name, however it is written) before they are counted, and resolved in
# one query: a thousand is far past any fleet's group and keeps that query's parameters bounded.
MAX_SELECTORS = 64
# And their requirements in all: each is a few terms of the workloads' query, and SQLite refuses an
# expression deeper than 1,000 terms (PostgreSQL takes more, but the answer must not depend on the
# database).
MAX_SELECTION_REQUIREMENTS = 256
MAX_WORKLOAD_IDS = 1000
# The label keys that name a group for suggested rules: a rule's scope is a selector of one value per
# key, so a few keys already make every group its own.
MAX_LABEL_KEYS = 16
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
    "direction": ("direction",),
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


def direction_parse(value: Any) -> str:
    """`direction`: whose connections a read covers, `inbound` (the default: every answer as it was
    before outbound evidence), `outbound` or `any`."""
    if value is None or value == "":
        return Direction.INBOUND
    if not isinstance(value, str) or value not in READ_DIRECTIONS:
        raise ValidationFailed(
            [Finding("?direction", "direction", f"direction is one of {', '.join(READ_DIRECTIONS)}.")]
        )
    return value


def direction_filters(direction: str) -> dict:
    """The key columns' filter of a read's direction: none for `any`."""
    return {} if direction == ANY_DIRECTION else {"direction": direction}


@dataclass(frozen=True)
class FlowSelection:
    """A range of flow evidence and the workloads selected in it: ids and label selectors, ANDed; with
    neither, the whole fleet (flows.selectors.workloads_selected resolves them). `direction` says whose
    connections (`direction_parse`)."""

    start: datetime
    end: datetime
    labels: list[Selector]
    workload_ids: list[str]
    direction: str = Direction.INBOUND


QUERY, BODY = "query", "body"


def flow_selection_parse(
    *, start: Any, end: Any, labels: Any, workloads: Any, direction: Any = None, at: str = QUERY
) -> FlowSelection:
    """`from`, `to`, `label`, `workload` and `direction` as a range (`flow_range_parse`) and a
    selection, every finding at once. `at` says where they were given: query parameters (`?from`, `?label[1]`) or the
    members of a JSON body (`/from`, `/label/1`), where `label` and `workload` must be lists of strings
    and a `from` or `to` that is not a string is a malformed instant (rule `instant`), as its text would
    be in a query, not a missing one."""
    findings: list[Finding] = []
    range_ = labels_ = None
    try:
        range_ = flow_range_parse(start=_instant_text(start), end=_instant_text(end))
    except ValidationFailed as failed:
        findings.extend(failed.findings)
    label_texts = _texts("label", labels, findings)
    if len(label_texts) > MAX_SELECTORS:
        findings.append(
            Finding(
                "?label",
                "too-many",
                f"label may be given at most {MAX_SELECTORS} times (selectors are ANDed).",
            )
        )
        label_texts = []
    try:
        labels_ = label_filters_parse(label_texts)
    except ValidationFailed as failed:
        findings.extend(failed.findings)
    if labels_ is not None and sum(len(s.requirements) for s in labels_) > MAX_SELECTION_REQUIREMENTS:
        findings.append(
            Finding(
                "?label",
                "too-many",
                f"label's selectors hold at most {MAX_SELECTION_REQUIREMENTS} requirements in all.",
            )
        )
    workload_ids = _distinct_ids(_texts("workload", workloads, findings))
    if len(workload_ids) > MAX_WORKLOAD_IDS:
        findings.append(
            Finding(
                "?workload", "too-many", f"workload names at most {MAX_WORKLOAD_IDS} distinct workload ids."
            )
        )
    direction_ = Direction.INBOUND
    try:
        direction_ = direction_parse(direction)
    except ValidationFailed as failed:
        findings.extend(failed.findings)
    if findings:
        raise ValidationFailed([_at_body(f) for f in findings] if at == BODY else findings)
    assert range_ is not None and labels_ is not None  # noqa: S101  # else a finding was raised
    return FlowSelection(
        start=range_[0], end=range_[1], labels=labels_, workload_ids=workload_ids, direction=direction_
    )


def _instant_text(value: Any) -> str | None:
    return value if isinstance(value, str) or value is None else repr(value)


def _texts(name: str, value: Any, findings: list[Finding]) -> list[str]:
    if not isinstance(value, list | tuple) or not all(isinstance(item, str) for item in value):
        findings.append(Finding(f"?{name}", "type", f"{name} must be a list of strings."))
        return []
    return list(value)


def _distinct_ids(texts: list[str]) -> list[str]:
    """Workload ids once each, in their first order: the same UUID however written (case, braces) is
    one id; a text that is no UUID is kept as given (it names no workload: not found)."""
    seen: dict[object, str] = {}
    for text in texts:
        try:
            key: object = uuid.UUID(text)
        except ValueError:
            key = text
        seen.setdefault(key, text)
    return list(seen.values())


def _at_body(finding: Finding) -> Finding:
    """A query parameter's finding at the body's pointer: `?from` -> `/from`, `?label[1]` -> `/label/1`."""
    return Finding(
        re.sub(r"^\?([^\[]*)(?:\[(\d+)\])?$", _pointer, finding.path), finding.rule, finding.message
    )


def _pointer(match: re.Match) -> str:
    name, index = match.groups()
    return f"/{name}" + (f"/{index}" if index is not None else "")


# `app` alone: it names what a workload runs, the group that rules are written for
# (docs/labels-and-selectors.md). Every key must be on both ends of a connection for it to be
# generalised, so a second default key (`role`) would leave every workload without it out of the
# proposal; operators whose fleets label roles ask for both.
DEFAULT_LABEL_KEYS = ("app",)


def label_keys_parse(value: Any) -> list[str]:
    """Suggested rules' `label_keys`, the label keys that name a group of workloads (a caller whose
    request gives none passes DEFAULT_LABEL_KEYS), without repeats."""
    findings: list[Finding] = []
    keys = _texts("label_keys", value, findings)
    if len(keys) > MAX_LABEL_KEYS:
        findings.append(
            Finding("?label_keys", "too-many", f"label_keys may name at most {MAX_LABEL_KEYS} label keys.")
        )
        keys = []
    for index, key in enumerate(keys):
        try:
            validate_label_key(key)
        except GrammarError as error:
            findings.append(Finding(f"?label_keys[{index}]", error.rule, error.message))
    if not keys and not findings:
        findings.append(Finding("?label_keys", "empty", "label_keys needs at least one label key."))
    if findings:
        raise ValidationFailed([_at_body(f) for f in findings])
    return list(dict.fromkeys(keys))


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

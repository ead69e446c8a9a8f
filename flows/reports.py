"""An agent's flow report read and checked, before anything is stored: the envelope as a whole (a
malformed one refuses the report), then each window and gap on its own (a malformed one is refused with
its reason and the rest of the report still lands). Nothing here touches the database.
"""

from __future__ import annotations

import functools
import ipaddress
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.conf import settings

from agent import protocol
from controlplane import runtime
from controlplane.problems import Finding, ValidationFailed
from controlplane.text import has_unsafe, visible
from controlplane.validation import is_digits, parse_instant
from flows.choices import AGENT_GAP_KINDS, AGGREGATE, MAX_WINDOW_SECONDS, Decision, Direction, GapSource

# The most windows and gaps the gateway accepts in one report (docs/protocol.md). The agent sends fewer
# (agent/flowreporter.py, BATCH_MAX_WINDOWS and BATCH_MAX_GAPS; a test keeps them so).
ACCEPTED_MAX_WINDOWS = 1000
ACCEPTED_MAX_GAPS = 1000
MAX_RULE_NUMBER = (1 << 24) - 1
# The agent process's age: the control plane subtracts it from now (agent_silent), and a datetime
# cannot reach back further than year 1.
MAX_UPTIME = 100 * 365 * 86400
PROTOCOLS = ("tcp", "udp", "icmp", "icmpv6")
ACCEPTED, REFUSED = "accepted", "refused"
DECISIONS = frozenset(Decision.values)  # `.values` builds a list on every read: once per group is too often
DIRECTION_VALUES = tuple(Direction.values)  # in their order, once per report and window
DIRECTIONS = frozenset(DIRECTION_VALUES)


# Why a window or a gap is refused, for the metrics (controlplane/metrics.py counts these codes, never
# the messages): malformed, on a day outside the stored range, or an id another workload's item holds.
MALFORMED, OUTSIDE_STORED_RANGE, ID_TAKEN = "malformed", "outside_stored_range", "id_taken"
REFUSAL_CODES = (MALFORMED, OUTSIDE_STORED_RANGE, ID_TAKEN)


class Refused(ValueError):
    """One window or gap refused: `code` (one of REFUSAL_CODES) says why to the metrics, the message
    says it to the agent, which is sent it back."""

    def __init__(self, message: str, code: str = MALFORMED) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Report:
    """A report's envelope as checked: the fields of agent/protocol.py's FlowReport, parsed."""

    agent_clock: datetime
    process_start_id: str
    uptime_seconds: float
    window_seconds: int
    windows: list
    gaps: list


def report_envelope(data: Any) -> Report:
    findings: list[Finding] = []
    if not isinstance(data, dict):
        raise ValidationFailed([Finding("", "type", "A flow report is a JSON object.")])
    if data.get("v") != protocol.PROTOCOL_VERSION or data.get("type") != protocol.FlowReport.type:
        findings.append(
            Finding(
                "/type",
                "protocol-version",
                f"Expected a {protocol.FlowReport.type} of agent protocol {protocol.PROTOCOL_VERSION}.",
            )
        )
    agent_clock = parse_instant(data.get("agent_clock"))
    if agent_clock is None:
        findings.append(Finding("/agent_clock", "instant", "agent_clock is not an RFC 3339 instant."))
    process = data.get("process_start_id")
    if not isinstance(process, str) or not 0 < len(process) <= 64:
        findings.append(
            Finding("/process_start_id", "type", "process_start_id is a string of 1-64 characters.")
        )
    elif has_unsafe(process):
        findings.append(
            Finding(
                "/process_start_id",
                "control-characters",
                "process_start_id has control or format characters.",
            )
        )
    uptime = data.get("uptime_seconds")
    if isinstance(uptime, bool) or not isinstance(uptime, int | float) or not 0 <= uptime <= MAX_UPTIME:
        findings.append(
            Finding(
                "/uptime_seconds",
                "out-of-range",
                "uptime_seconds is a number of seconds from 0 to 3153600000 (a hundred years).",
            )
        )
    window_seconds = data.get("window_seconds")
    if (
        isinstance(window_seconds, bool)
        or not isinstance(window_seconds, int)
        or not 1 <= window_seconds <= MAX_WINDOW_SECONDS
    ):
        findings.append(
            Finding("/window_seconds", "out-of-range", "window_seconds is a whole number from 1 to 3600.")
        )
    for key, maximum in (("windows", ACCEPTED_MAX_WINDOWS), ("gaps", ACCEPTED_MAX_GAPS)):
        if not isinstance(data.get(key, []), list):
            findings.append(Finding(f"/{key}", "type", f"{key} is a list."))
        elif len(data.get(key, [])) > maximum:
            findings.append(Finding(f"/{key}", "too-many", f"At most {maximum} {key} per report."))
    unknown = set(data) - {"v", "type", *protocol.FLOW_REPORT_FIELDS}
    for name in sorted(unknown)[:5]:
        findings.append(Finding(f"/{name}"[:80], "unknown-field", "Not a field of a flow report."))
    if findings:
        raise ValidationFailed(findings)
    return Report(
        agent_clock, process, float(uptime), window_seconds, data.get("windows", []), data.get("gaps", [])
    )


def _id(raw: Any) -> uuid.UUID:
    try:
        if isinstance(raw, str):
            return uuid.UUID(raw)
    except ValueError:
        pass
    raise Refused("id is not a UUID")


def _instant(raw: Any, name: str) -> datetime:
    parsed = parse_instant(raw)
    if parsed is None:
        raise Refused(f"{name} is not an RFC 3339 instant")
    return parsed


# What one window may count: far beyond any host (four billion connections; 18 PB, and a connection's
# bytes all come in the window it ends: over two weeks at 100 Gb/s), and low enough that a quarter day
# of one key's minute windows sums within a 64-bit column. A flood of windows that still overflows one
# is left out of the sums alone (flows.services).
MAX_CONNECTIONS = (1 << 32) - 1
MAX_BYTES = (1 << 54) - 1


def _count(raw: Any, name: str, most: int) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= most:
        raise Refused(f"{name} is a whole number from 0 to {most}")
    return raw


def _peer(raw: Any) -> str:
    return peer_address(raw) if isinstance(raw, str) and len(raw) <= 64 else peer_address("")


@functools.lru_cache(maxsize=65536)  # a fleet's peers recur in every report
def peer_address(raw: str) -> str:
    """A peer as stored: the compressed address, an IPv4-mapped IPv6 address as its IPv4 one (conntrack
    reports a dual-stack socket's IPv4 peers so); refused with the reason otherwise. Filters read
    peers through it too, so that they match what was stored."""
    try:
        address = ipaddress.ip_address(raw)
    except ValueError:
        raise Refused("peer is not an IP address") from None
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:
            raise Refused("peer carries a zone (%...): give the address alone")
        if address.ipv4_mapped:
            return address.ipv4_mapped.compressed
    return address.compressed


def _window(raw: Any, *, window_seconds: int) -> tuple[uuid.UUID, datetime, datetime, dict]:
    if not isinstance(raw, dict):
        raise Refused("a window is a JSON object")
    window_id = _id(raw.get("id"))
    start, end = _instant(raw.get("start"), "start"), _instant(raw.get("end"), "end")
    if end - start != timedelta(seconds=window_seconds):
        raise Refused(f"a window is {window_seconds} s long, from start to end")
    if not isinstance(raw.get("policy_version", ""), str) or len(raw.get("policy_version", "")) > 80:
        raise Refused("policy_version is a string of at most 80 characters")
    if not isinstance(raw.get("accounting"), bool):
        raise Refused("accounting is true or false")
    groups = raw.get("groups")
    if not isinstance(groups, list) or not groups:
        raise Refused("groups is a list of at least one key")
    return window_id, start, end, {**raw, "policy_version": visible(raw.get("policy_version", ""))[:80]}


def _key(raw: dict) -> tuple[str, str, int, int | None]:
    """The group's peer, protocol, port and rule, as stored: an address and a protocol, or the
    aggregate key (flows.choices.AGGREGATE), which an agent sends for the keys over its own bound."""
    protocol, port, rule = raw.get("protocol"), raw.get("port"), raw.get("rule")
    if AGGREGATE in (raw.get("peer"), protocol):
        if (raw.get("peer"), protocol, port, rule) != (AGGREGATE, AGGREGATE, 0, None) or isinstance(
            port, bool
        ):
            raise Refused(
                f"the aggregate key is peer {AGGREGATE}, protocol {AGGREGATE}, port 0 and rule null"
            )
        return AGGREGATE, AGGREGATE, 0, None
    if protocol not in PROTOCOLS and not (
        isinstance(protocol, str) and is_digits(protocol) and int(protocol) < 256
    ):
        raise Refused("protocol is tcp, udp, icmp, icmpv6 or a protocol number")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise Refused("port is a whole number from 0 to 65535")
    if rule is not None and (
        isinstance(rule, bool) or not isinstance(rule, int) or not 0 < rule <= MAX_RULE_NUMBER
    ):
        raise Refused("rule is a rule number or null")
    return _peer(raw.get("peer")), protocol, port, rule


def _group(raw: Any, *, start: datetime, end: datetime, accounting: bool) -> dict:
    """A window's key as stored, or Refused with the first reason `_group_checked` finds."""
    group = _group_plain(raw, start, end, accounting)
    return _group_checked(raw, start=start, end=end, accounting=accounting) if group is None else group


_PROTOCOL_NAMES = frozenset(PROTOCOLS)


def _group_plain(raw: Any, start: datetime, end: datetime, accounting: bool) -> dict | None:
    """The key as `_group_checked` would store it when it is a plain one (an address, a protocol of
    PROTOCOLS, the values of exactly the classes JSON decodes them to), else None: anything else,
    refused or not, is `_group_checked`'s. A report's fifty keys each went through a dozen calls and
    isinstance pairs there (about 6 us a key); here one pass of class tests (a bool is not `int` by
    class), half of it. Accepting only a subset of what `_group_checked` accepts, it stores the same."""
    if raw.__class__ is not dict:
        return None
    get = raw.get
    peer, protocol, port, rule = get("peer"), get("protocol"), get("port"), get("rule")
    decision = get("decision")
    direction = get("direction", Direction.INBOUND)  # absent: an agent from before outbound evidence
    failsafe = get("failsafe", False)
    first_seen, last_seen = get("first_seen"), get("last_seen")
    connections, bytes_in, bytes_out = get("connection_count"), get("bytes_in"), get("bytes_out")
    if not (
        peer.__class__ is str
        and protocol.__class__ is str
        and protocol in _PROTOCOL_NAMES
        and port.__class__ is int
        and 0 <= port <= 65535
        and (rule is None or (rule.__class__ is int and 0 < rule <= MAX_RULE_NUMBER))
        and decision.__class__ is str
        and decision in DECISIONS
        and direction.__class__ in _TEXT
        and direction in DIRECTIONS
        and failsafe is False
        and connections.__class__ is int
        and 0 <= connections <= MAX_CONNECTIONS
        and bytes_in.__class__ is int
        and bytes_out.__class__ is int
        and 0 <= bytes_in <= MAX_BYTES
        and 0 <= bytes_out <= MAX_BYTES
        and (accounting or not (bytes_in or bytes_out))
        and len(peer) <= 64
    ):
        return None
    # Both instants in the agents' form (`parse_instant`'s first case, inline: two calls a key cost
    # more than the parse), else `_group_checked`'s.
    if not (
        first_seen.__class__ is str
        and last_seen.__class__ is str
        and len(first_seen) == 27 == len(last_seen)
        and first_seen[4:20:3] == "--T::." == last_seen[4:20:3]
        and first_seen[26] == "Z" == last_seen[26]
        and first_seen.isascii()
        and last_seen.isascii()
    ):
        return None
    try:
        first, last = _fromisoformat(first_seen), _fromisoformat(last_seen)
    except ValueError:
        return None
    if not start <= first <= last <= end:
        return None
    try:
        peer = peer_address(peer)
    except Refused:
        return None
    return {
        "peer": peer,
        "protocol": protocol,
        "port": port,
        "decision": decision,
        "rule_number": rule,
        "direction": direction,
        "failsafe": False,
        "connection_count": connections,
        "first_seen": first,
        "last_seen": last,
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
    }


_fromisoformat = datetime.fromisoformat
_TEXT = frozenset((str, Direction))  # a direction as decoded, or the default an absent one takes


def _group_checked(raw: Any, *, start: datetime, end: datetime, accounting: bool) -> dict:
    if not isinstance(raw, dict):
        raise Refused("a group is a JSON object")
    peer, protocol, port, rule = _key(raw)
    decision = raw.get("decision")
    if not isinstance(decision, str) or decision not in DECISIONS:  # a set: a list or object would raise
        raise Refused(f"decision is one of {', '.join(Decision.values)}")
    direction = raw.get("direction", Direction.INBOUND)  # absent: an agent from before outbound evidence
    if not isinstance(direction, str) or direction not in DIRECTIONS:
        raise Refused("direction is inbound or outbound")
    failsafe = raw.get("failsafe", False)
    if not isinstance(failsafe, bool):
        raise Refused("failsafe is true or false")
    if failsafe and (decision != Decision.ALLOWED or rule is not None or peer == AGGREGATE):
        raise Refused("failsafe marks an allowed key of a peer with no rule")
    first_seen, last_seen = (
        _instant(raw.get("first_seen"), "first_seen"),
        _instant(raw.get("last_seen"), "last_seen"),
    )
    if not start <= first_seen <= last_seen <= end:
        raise Refused("first_seen and last_seen lie in the window, in that order")
    bytes_in = _count(raw.get("bytes_in"), "bytes_in", MAX_BYTES)
    bytes_out = _count(raw.get("bytes_out"), "bytes_out", MAX_BYTES)
    if not accounting and (bytes_in or bytes_out):
        raise Refused("bytes are counted only with accounting")
    return {
        "peer": peer,
        "protocol": protocol,
        "port": port,
        "decision": decision,
        "rule_number": rule,
        "direction": direction,
        "failsafe": failsafe,
        "connection_count": _count(raw.get("connection_count"), "connection_count", MAX_CONNECTIONS),
        "first_seen": first_seen,
        "last_seen": last_seen,
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
    }


def _gap(raw: Any) -> tuple[uuid.UUID, dict]:
    if not isinstance(raw, dict):
        raise Refused("a gap is a JSON object")
    gap_id = _id(raw.get("id"))
    if raw.get("kind") not in AGENT_GAP_KINDS:
        raise Refused(f"kind is one of {', '.join(AGENT_GAP_KINDS)}")
    if raw.get("source") is not None and raw.get("source") not in GapSource.values:
        raise Refused("source is conntrack, nflog or null")
    start, end = _instant(raw.get("start"), "start"), _instant(raw.get("end"), "end")
    if not start < end:
        raise Refused("a gap ends after it starts")
    lost = raw.get("lost", {})
    if (
        not isinstance(lost, dict)
        or len(lost) > 8
        or not all(
            isinstance(k, str) and len(k) <= 16 and not isinstance(v, bool) and isinstance(v, int) and v >= 0
            for k, v in lost.items()
        )
    ):
        raise Refused("lost maps at most 8 names to whole numbers")
    return gap_id, {
        "kind": raw["kind"],
        "source": raw.get("source"),
        "start": start,
        "end": end,
        # Names are the agent's free text, escaped (controlplane/text.py) so that no read shows them raw;
        # refusing the gap for a name would lose the evidence that something was lost.
        "lost": {visible(name): count for name, count in lost.items()},
    }


def item_answer(raw: Any, refused: Refused | None = None) -> dict:
    """A window's or gap's answer: accepted, or refused with the reason."""
    item_id = raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) else None
    if refused is None:
        return {"id": item_id[:64] if item_id else None, "result": ACCEPTED, "reason": None}
    return {"id": item_id[:64] if item_id else None, "result": REFUSED, "reason": str(refused)}


def _stored_days(now: datetime) -> tuple[date, date]:
    """The days evidence may lie on: back to the retention (older would be removed at once), and a
    year ahead (an agent's clock may be off, but not by years). Bounds the partitions a report makes."""
    today = now.astimezone(UTC).date()
    return today - timedelta(days=runtime.facts.retention_days), today + timedelta(days=366)


def _check_stored_day(instant: datetime, name: str, days: tuple[date, date]) -> None:
    if not days[0] <= instant.astimezone(UTC).date() <= days[1]:
        raise Refused(
            f"{name} lies outside the stored range: back to the retention, a year ahead", OUTSIDE_STORED_RANGE
        )


@dataclass(frozen=True)
class Aggregated:
    """What the control plane summed into a window's aggregate keys: how many keys, and the
    connections they counted (the `keys_aggregated` gap it records says so)."""

    keys: int
    connections: int


@dataclass(frozen=True)
class ParsedWindow:
    id: uuid.UUID
    start: datetime
    end: datetime
    policy_version: str
    accounting: bool
    groups: list[dict]
    aggregated: Aggregated | None = None  # keys over the bound summed here, not by the agent


def _weight(group: dict) -> tuple:
    # The keys a window keeps one by one: those that counted most (then by key, so the same window
    # always keeps the same ones).
    return (
        -group["connection_count"],
        -(group["bytes_in"] + group["bytes_out"]),
        group["direction"], group["peer"], group["protocol"], group["port"], group["decision"],
        group["rule_number"] or 0, group["failsafe"],
    )  # fmt: skip


def _aggregate_key(decision: str, direction: str, groups: list[dict]) -> dict:
    summed = {
        "peer": AGGREGATE,
        "protocol": AGGREGATE,
        "port": 0,
        "decision": decision,
        "rule_number": None,
        "direction": direction,
        "failsafe": False,
        "connection_count": sum(g["connection_count"] for g in groups),
        "first_seen": min(g["first_seen"] for g in groups),
        "last_seen": max(g["last_seen"] for g in groups),
        "bytes_in": sum(g["bytes_in"] for g in groups),
        "bytes_out": sum(g["bytes_out"] for g in groups),
    }
    if (
        summed["connection_count"] > MAX_CONNECTIONS
        or max(summed["bytes_in"], summed["bytes_out"]) > MAX_BYTES
    ):
        raise Refused("the keys over the bound sum past what one window may count")
    return summed


def keys_fold(groups: list[dict], *, keep: Mapping[str, int]) -> tuple[list[dict], Aggregated | None]:
    """A window's groups with at most `keep[direction]` keys one by one in each direction: the others,
    and any aggregate key the agent sent, summed into one aggregate key per decision and direction.
    Each direction has its own bound, so keys of one never push the other's into the aggregate.
    Returns the groups and what was summed here (None when nothing was)."""
    aggregates = [g for g in groups if g["peer"] == AGGREGATE]
    by_direction: dict[str, list[dict]] = {}
    for group in groups:
        if group["peer"] != AGGREGATE:
            by_direction.setdefault(group["direction"], []).append(group)
    if all(len(keys) <= keep[direction] for direction, keys in by_direction.items()):
        return groups, None
    kept: list[dict] = []
    over: list[dict] = []
    for direction, keys in by_direction.items():
        keys.sort(key=_weight)
        kept += keys[: keep[direction]]
        over += keys[keep[direction] :]
    by_decision: dict[tuple[str, str], list[dict]] = {}
    for group in over + aggregates:
        by_decision.setdefault((group["decision"], group["direction"]), []).append(group)
    summed = [
        _aggregate_key(decision, direction, listed)
        for (decision, direction), listed in sorted(by_decision.items())
    ]
    return kept + summed, Aggregated(len(over), sum(g["connection_count"] for g in over))


def keys_by_direction(groups: list[dict]) -> Counter:
    """The keys kept one by one of each direction (the aggregate keys are not among them)."""
    return Counter(group["direction"] for group in groups if group["peer"] != AGGREGATE)


def keys_fold_counted(
    groups: list[dict], *, keep: Mapping[str, int]
) -> tuple[list[dict], Aggregated | None, Counter]:
    """`keys_fold`, with `keys_by_direction` of the groups it returns. Within the bound (nearly every
    window: nothing folded), the keys are counted once and the groups returned as they are, which is
    what `keys_fold` returns then (its own test, on the same counts); each window is bounded twice, at
    the parse and again at the write, and the fold's passes cost more than its count."""
    counts = keys_by_direction(groups)
    if all(keys <= keep[direction] for direction, keys in counts.items()):
        return groups, None, counts
    folded, summed = keys_fold(groups, keep=keep)
    return folded, summed, keys_by_direction(folded)


@dataclass(frozen=True)
class ParsedReport:
    """A report whose every window and gap has been checked: each item is its raw form (for the answer)
    with either what it parsed to or why it is refused."""

    envelope: Report
    windows: list[tuple[Any, ParsedWindow | Refused]]
    gaps: list[tuple[Any, tuple[uuid.UUID, dict] | Refused]]
    days: set[date]  # the days its rows fall on (windows by start, gaps by end, and today)


def report_parse(data: Any, *, now: datetime) -> ParsedReport:
    """Check a report against the stored range of days around `now`; raises ValidationFailed for a
    malformed envelope only.

    Keys are bounded in each direction: a window keeps at most PALISADE_FLOW_WINDOW_MAX_KEYS keys one
    by one, and a report PALISADE_FLOW_REPORT_MAX_KEYS in all (its windows in order; a window past the
    report's bound keeps none). The rest are summed into each window's aggregate keys (`keys_fold`), never
    dropped, and the window says how many (`ParsedWindow.aggregated`)."""
    envelope = report_envelope(data)
    stored = _stored_days(now)
    today = now.astimezone(UTC).date()
    windows: list[tuple[Any, ParsedWindow | Refused]] = []
    row_days = {today}
    per_window = settings.PALISADE_FLOW_WINDOW_MAX_KEYS
    left = dict.fromkeys(DIRECTION_VALUES, settings.PALISADE_FLOW_REPORT_MAX_KEYS)
    for raw in envelope.windows:
        try:
            window_id, start, end, body = _window(raw, window_seconds=envelope.window_seconds)
            _check_stored_day(start, "start", stored)
            groups = [_group(g, start=start, end=end, accounting=body["accounting"]) for g in body["groups"]]
            keep = {direction: min(per_window, room) for direction, room in left.items()}
            groups, aggregated, counts = keys_fold_counted(groups, keep=keep)
            windows.append(
                (
                    raw,
                    ParsedWindow(
                        window_id,
                        start,
                        end,
                        body.get("policy_version", ""),
                        body["accounting"],
                        groups,
                        aggregated,
                    ),  # fmt: skip
                )
            )
            for direction, keys in counts.items():
                left[direction] -= keys
            row_days.add(start.astimezone(UTC).date())
        except Refused as refused:
            windows.append((raw, refused))
    gaps: list[tuple[Any, tuple[uuid.UUID, dict] | Refused]] = []
    for raw in envelope.gaps:
        try:
            gap_id, gap = _gap(raw)
            _check_stored_day(gap["end"], "end", stored)
            gaps.append((raw, (gap_id, gap)))
            row_days.add(gap["end"].astimezone(UTC).date())
        except Refused as refused:
            gaps.append((raw, refused))
    return ParsedReport(envelope, windows, gaps, row_days)

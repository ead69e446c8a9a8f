"""What a policy write admits: parses request bodies into specs, with one finding per field to fix.

The API and the command line both pass the parsed JSON body through these functions, so they admit
exactly the same things and report the same findings. Rules that need the database (unknown
references, duplicate names) are checked in services.py with the same finding shape.
"""

from __future__ import annotations

import ipaddress
import unicodedata
import uuid
from dataclasses import dataclass
from typing import Any

from controlplane.problems import pointer
from controlplane.validation import (
    Findings,
    quoted,
    reject_unknown,
    require_object,
    take_bool,
    take_int,
    take_string,
)
from policy.grammar import GrammarError, parse_selector

PROTOCOLS = ("tcp", "udp", "icmp", "icmpv6")
PORTED = ("tcp", "udp")
ACTIONS = ("allow", "deny")  # policy.choices.RuleAction; the first is the default
DIRECTIONS = ("inbound", "outbound")  # policy.choices.Direction; the first is the default

MAX_NAME = 100
MAX_DESCRIPTION = 1000
MAX_SERVICE_ENTRIES = 64
MAX_GROUP_MEMBERS = 10_000
MAX_RULES_PER_RULESET = 500
MAX_SOURCES_PER_RULE = 64
MAX_SERVICES = 1000
MAX_ADDRESS_GROUPS = 1000
MAX_RULESETS = 1000

# What a read returns beyond what a write takes: accepted and ignored, so a body read with GET can be
# edited and sent back with PUT.
READ_ONLY = frozenset({"id", "version", "created_at", "updated_at"})
MAX_SERVICES_PER_RULE = 64


@dataclass(frozen=True)
class PortEntrySpec:
    protocol: str
    port: int | None
    port_to: int | None


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    description: str
    entries: tuple[PortEntrySpec, ...]


@dataclass(frozen=True)
class AddressGroupSpec:
    name: str
    description: str
    members: tuple[str, ...]


@dataclass(frozen=True)
class SourceSpec:
    kind: str  # "selector", "address_group" or "any"
    selector: str = ""  # canonical text
    reference: str = ""  # address group id or name, as given
    path: str = ""


@dataclass(frozen=True)
class ServiceRefSpec:
    reference: str = ""  # service id or name, as given; empty for an inline entry
    entry: PortEntrySpec | None = None
    path: str = ""


@dataclass(frozen=True)
class RuleSpec:
    id: str | None
    description: str
    sources: tuple[SourceSpec, ...]
    services: tuple[ServiceRefSpec, ...]
    path: str = ""
    action: str = "allow"


@dataclass(frozen=True)
class RulesetSpec:
    name: str
    description: str
    enabled: bool
    scope: str
    rules: tuple[RuleSpec, ...]
    direction: str = "inbound"


def _take_list(data, key, findings, *, base: str, maximum: int, required: bool = True) -> list:
    path = base + pointer(key)
    if key not in data:
        if required:
            findings.add(path, "required", f"{key} is required.")
        return []
    value = data[key]
    if not isinstance(value, list):
        findings.add(path, "type", f"{key} must be a list.")
        return []
    if len(value) > maximum:
        findings.add(path, "too-many", f"{key} may have at most {maximum} items.")
        return []
    return value


def _take_name(data, findings, base: str = "") -> str:
    name = take_string(data, "name", findings, base=base, min_length=1, max_length=MAX_NAME)
    if name and name != name.strip():
        findings.add(base + "/name", "name-whitespace", "name must not start or end with whitespace.")
    if name and _looks_like_id(name):
        findings.add(base + "/name", "name-is-id", "name must not look like an object id.")
    if name and (problem := lookalike_problem(name)) is not None:
        findings.add(base + "/name", "name-lookalike", f"name {problem}.")
    return name


# Cyrillic and Greek letters that look like Latin ones: a name written in them alone reads as a Latin
# name it is not (`раураl` for `paypal`). Mixed with Latin letters they are refused anyway.
_LATIN_LOOKALIKES = frozenset(
    "АВЕЅІЈКМНОРСТХУаеіјорсхуѕԁһԛԝүӏ"  # Cyrillic
    "ΑΒΕΖΗΙΚΜΝΟΡΤΥΧοϲνι"  # Greek
)
# Letters of these scripts are written together in one name (Japanese, Chinese, Korean).
_HAN_FAMILY = frozenset({"CJK", "HIRAGANA", "KATAKANA", "KATAKANA-HIRAGANA", "HANGUL", "BOPOMOFO"})


def _script(character: str) -> str | None:
    """The script of a letter by the first word of its Unicode name (LATIN, CYRILLIC, GREEK, CJK ...);
    None for what is not a letter (digits, punctuation, the space)."""
    if not unicodedata.category(character).startswith("L"):
        return None
    script = unicodedata.name(character, "?").split(" ", 1)[0]
    return "HAN" if script in _HAN_FAMILY else script


def lookalike_problem(text: str) -> str | None:
    """Why a name could be taken for another, or None. A name is what an operator reads in a plan, a
    console or an audit trail and matches by eye, so it must read as what it is: its NFKC form is
    itself (no full-width `ｗｅｂ`, no ligature, no compatibility form), every character is visible
    (no zero-width, format, private-use, unassigned or separator character but the ASCII space), its
    letters are of one script (no Latin word with a Cyrillic `а` in it; Chinese, Japanese and Korean
    count as one), and it is not written wholly in Cyrillic or Greek letters that look like Latin ones."""
    normalised = unicodedata.normalize("NFKC", text)
    if normalised != text:
        return f"must be written in its normal form (NFKC: {normalised!r}): compatibility forms look like other text"
    for position, character in enumerate(text):
        category = unicodedata.category(character)
        if character != " " and (category[0] in "CZ" or category in ("Mn", "Me") and position == 0):
            return f"contains U+{ord(character):04X} at position {position}, which is not a visible character"
    scripts = {script for script in map(_script, text) if script is not None}
    if len(scripts) > 1:
        return f"mixes the letters of {', '.join(sorted(scripts)).lower()} scripts: it could pass for another name"
    letters = [character for character in text if _script(character) is not None]
    if letters and scripts <= {"CYRILLIC", "GREEK"} and all(c in _LATIN_LOOKALIKES for c in letters):
        return "is written in Cyrillic or Greek letters that look like Latin ones: it could pass for a Latin name"
    return None


def _looks_like_id(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def port_entry_input(data: Any, findings: Findings, base: str) -> PortEntrySpec | None:
    if not isinstance(data, dict):
        findings.add(base, "type", "A port entry must be an object.")
        return None
    before = len(findings.items)
    reject_unknown(data, {"protocol", "port", "port_to"}, findings, base)
    protocol = take_string(data, "protocol", findings, base=base, max_length=10)
    if protocol and protocol not in PROTOCOLS:
        findings.add(base + "/protocol", "protocol", f"protocol must be one of {', '.join(PROTOCOLS)}.")
    port = take_int(data, "port", findings, base=base, minimum=1, maximum=65535)
    port_to = take_int(data, "port_to", findings, base=base, minimum=1, maximum=65535)
    if protocol in PORTED:
        if port is None and "port" not in data:
            findings.add(
                base + "/port", "port-required", f"{protocol} entries need a port (and port_to for a range)."
            )
        if port is not None and port_to is not None and port_to < port:
            findings.add(base + "/port_to", "port-range-order", "port_to must not be below port.")
    elif protocol in PROTOCOLS:
        for key in ("port", "port_to"):
            if key in data:
                findings.add(base + pointer(key), "port-not-allowed", f"{protocol} entries have no ports.")
    if len(findings.items) > before:
        return None
    if port_to == port:
        port_to = None
    return PortEntrySpec(protocol=protocol, port=port, port_to=port_to)


def service_input(data: Any) -> ServiceSpec:
    data = require_object(data)
    findings = Findings()
    reject_unknown(data, READ_ONLY | {"name", "description", "entries"}, findings)
    name = _take_name(data, findings)
    description = take_string(data, "description", findings, required=False, max_length=MAX_DESCRIPTION)
    raw = _take_list(data, "entries", findings, base="", maximum=MAX_SERVICE_ENTRIES)
    if "entries" in data and isinstance(data["entries"], list) and not data["entries"]:
        findings.add("/entries", "empty", "A service needs at least one entry.")
    entries = [port_entry_input(item, findings, pointer("entries", i)) for i, item in enumerate(raw)]
    findings.raise_if_any()
    return ServiceSpec(name=name, description=description, entries=_unique(entries))


def _unique(items):
    return tuple(dict.fromkeys(items))


def normalise_member(text: str) -> str:
    """An address or network in canonical form: single hosts without a prefix length."""
    return _member_normalised(text)[0]


def _member_normalised(text: str) -> tuple[str, tuple[int, int, int]]:
    """A member's canonical form and its place among a group's members (family, then address as an
    integer, then prefix length: a host last among the networks at its address), parsed once."""
    text = text.strip()
    if "/" not in text and "%" not in text:
        # A host, the usual member: its address alone (cheaper than a network, and the same text).
        try:
            address = ipaddress.ip_address(text)
            return str(address), (address.version, int(address), address.max_prefixlen)
        except ValueError:
            pass  # ip_network says why
    network = ipaddress.ip_network(text, strict=True)
    first = network.network_address
    if network.num_addresses == 1:
        return str(first), (first.version, int(first), first.max_prefixlen)
    return str(network), (network.version, int(first), network.prefixlen)


def address_group_input(data: Any) -> AddressGroupSpec:
    data = require_object(data)
    findings = Findings()
    reject_unknown(data, READ_ONLY | {"name", "description", "members"}, findings)
    name = _take_name(data, findings)
    description = take_string(data, "description", findings, required=False, max_length=MAX_DESCRIPTION)
    raw = _take_list(data, "members", findings, base="", maximum=MAX_GROUP_MEMBERS)
    members: dict[str, tuple[int, int, int]] = {}  # canonical text -> its place
    for index, item in enumerate(raw):
        path = pointer("members", index)
        if not isinstance(item, str):
            findings.add(path, "type", "A member must be a string: an IPv4 or IPv6 address or CIDR.")
            continue
        if "%" in item:
            # ipaddress accepts fe80::1%eth0, but a zone names an interface of one host and the
            # renderer cannot put it in a set: every workload using the group would fail to render.
            findings.add(
                path,
                "address-zone",
                f"{quoted(item)} has an IPv6 zone (after '%'); a member names an address without a zone.",
            )
            continue
        try:
            text, place = _member_normalised(item)
            members[text] = place
        except ValueError:
            try:
                network = ipaddress.ip_network(item.strip(), strict=False)
                findings.add(
                    path, "cidr-host-bits", f"{quoted(item)} has host bits set; did you mean {network}?"
                )
            except ValueError:
                findings.add(path, "address", f"{quoted(item)} is not an IPv4 or IPv6 address or CIDR.")
    findings.raise_if_any()
    return AddressGroupSpec(
        name=name, description=description, members=tuple(sorted(members, key=members.__getitem__))
    )


def selector_input(value: Any, findings: Findings, path: str) -> str:
    try:
        return str(parse_selector(value))
    except GrammarError as error:
        findings.add(path, error.rule, error.message)
        return ""


def _source_input(item: Any, findings: Findings, path: str) -> SourceSpec | None:
    if not isinstance(item, dict) or len(item) != 1:
        findings.add(
            path,
            "source",
            'A source is one of {"selector": "..."}, {"address_group": "id or name"}, {"any": true}.',
        )
        return None
    ((key, value),) = item.items()
    if key == "selector":
        if not isinstance(value, str):
            findings.add(path + "/selector", "type", "selector must be a string.")
            return None
        text = selector_input(value, findings, path + "/selector")
        return SourceSpec(kind="selector", selector=text, path=path)
    if key == "address_group":
        if not isinstance(value, str) or not value:
            findings.add(
                path + "/address_group", "type", "address_group must be an address group id or name."
            )
            return None
        return SourceSpec(kind="address_group", reference=value, path=path)
    if key == "any":
        if value is not True:
            findings.add(path + "/any", "type", "any must be true.")
            return None
        return SourceSpec(kind="any", path=path)
    findings.add(path + pointer(key), "unknown-field", f"Unknown source kind {quoted(key)}.")
    return None


def _service_ref_input(item: Any, findings: Findings, path: str) -> ServiceRefSpec | None:
    if isinstance(item, dict) and set(item) == {"service"}:
        if not isinstance(item["service"], str) or not item["service"]:
            findings.add(path + "/service", "type", "service must be a service id or name.")
            return None
        return ServiceRefSpec(reference=item["service"], path=path)
    entry = port_entry_input(item, findings, path)
    return ServiceRefSpec(entry=entry, path=path) if entry else None


def peers_key(direction: str) -> str:
    """What a rule of a ruleset of `direction` calls its peers: the sources of the connections it
    judges (inbound), or their destinations (outbound)."""
    return "destinations" if direction == DIRECTIONS[1] else "sources"


def rule_input(
    data: Any, *, base: str = "", allow_id: bool = False, direction: str = "inbound"
) -> tuple[RuleSpec | None, Findings]:
    findings = Findings()
    if not isinstance(data, dict):
        findings.add(base, "type", "A rule must be an object.")
        return None, findings
    key = peers_key(direction)
    other = peers_key(DIRECTIONS[0] if key == "destinations" else DIRECTIONS[1])
    if other in data:
        findings.add(
            base + pointer(other),
            "direction",
            f"A rule of an {direction} ruleset has {key}, not {other}.",
        )
    allowed = READ_ONLY | {"number", "description", "action", key, "services"}  # number: read-only
    reject_unknown({k: v for k, v in data.items() if k != other}, allowed, findings, base)
    action = _take_action(data, findings, base)
    rule_id = None
    if allow_id and "id" in data:
        rule_id = data["id"]
        if not isinstance(rule_id, str) or not _looks_like_id(rule_id):
            findings.add(base + "/id", "type", "id must be the id of a rule of this ruleset.")
            rule_id = None
    description = take_string(
        data, "description", findings, base=base, required=False, max_length=MAX_DESCRIPTION
    )
    raw_sources = _take_list(data, key, findings, base=base, maximum=MAX_SOURCES_PER_RULE)
    raw_services = _take_list(data, "services", findings, base=base, maximum=MAX_SERVICES_PER_RULE)
    for name in (key, "services"):
        if name in data and isinstance(data[name], list) and not data[name]:
            findings.add(base + pointer(name), "empty", f"A rule needs at least one of {name}.")
    sources = [_source_input(item, findings, base + pointer(key, i)) for i, item in enumerate(raw_sources)]
    services = [
        _service_ref_input(item, findings, base + pointer("services", i))
        for i, item in enumerate(raw_services)
    ]
    if findings:
        return None, findings
    spec = RuleSpec(
        id=str(uuid.UUID(rule_id)) if rule_id else None,
        description=description,
        sources=tuple(sources),
        services=tuple(services),
        path=base,
        action=action,
    )
    return spec, findings


def _take_action(data: dict, findings: Findings, base: str) -> str:
    # Absent means allow: every rule, file and request written before deny existed keeps its meaning.
    if "action" not in data:
        return ACTIONS[0]
    value = data["action"]
    if not isinstance(value, str) or value not in ACTIONS:
        findings.add(
            base + "/action",
            "action",
            f"action must be one of {', '.join(ACTIONS)}, not {quoted(value)}.",
        )
        return ACTIONS[0]
    return value


def single_rule_input(data: Any, *, direction: str = "inbound") -> RuleSpec:
    spec, findings = rule_input(require_object(data), direction=direction)
    findings.raise_if_any()
    return spec


def ruleset_input(data: Any) -> RulesetSpec:
    data = require_object(data)
    findings = Findings()
    reject_unknown(
        data, READ_ONLY | {"name", "description", "enabled", "scope", "direction", "rules"}, findings
    )
    name = _take_name(data, findings)
    # Absent means inbound: every ruleset, file and request written before outbound keeps its meaning.
    direction = data.get("direction", DIRECTIONS[0])
    if direction not in DIRECTIONS:
        findings.add(
            "/direction",
            "direction",
            f"direction must be one of {', '.join(DIRECTIONS)}, not {quoted(direction)}.",
        )
        direction = DIRECTIONS[0]
    description = take_string(data, "description", findings, required=False, max_length=MAX_DESCRIPTION)
    enabled = take_bool(data, "enabled", findings, default=True)
    scope = ""
    if "scope" not in data:
        findings.add(
            "/scope", "required", "scope is required: the selector of the workloads this ruleset protects."
        )
    elif not isinstance(data["scope"], str):
        findings.add("/scope", "type", "scope must be a selector string.")
    else:
        scope = selector_input(data["scope"], findings, "/scope")
    raw_rules = _take_list(data, "rules", findings, base="", maximum=MAX_RULES_PER_RULESET, required=False)
    rules = []
    for index, item in enumerate(raw_rules):
        spec, rule_findings = rule_input(
            item, base=pointer("rules", index), allow_id=True, direction=direction
        )
        findings.extend(rule_findings.items)
        rules.append(spec)
    ids = [r.id for r in rules if r and r.id]
    for index, rule in enumerate(rules):
        if rule and rule.id and ids.count(rule.id) > 1:
            findings.add(pointer("rules", index, "id"), "duplicate-id", "The same rule id appears twice.")
    findings.raise_if_any()
    return RulesetSpec(
        name=name,
        description=description,
        enabled=enabled,
        scope=scope,
        rules=tuple(rules),
        direction=direction,
    )

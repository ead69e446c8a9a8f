"""Policy as code: the authored policy as one reviewable file, and a plan/apply cycle over it.

The file holds services, address groups and rulesets with their rules, in the shape of the API's write
bodies but naming objects instead of giving their ids, with no versions or timestamps: an export is
sorted by name and deterministic, so two exports of the same policy are byte-identical and a diff in
git shows only real changes. Objects are identified by name (a rename is a delete and a create); the
rules of a ruleset keep their order, which is semantic.

`policy_plan` compares the file with the stored policy object by object and field by field, and says
what a render dry-run and the impact over past traffic make of it; `policy_apply` performs the same
plan through the API's own write functions (policy/services.py) in one transaction, refusing when
the policy version moved since the plan. A rule written without a number (by hand) is matched to a
stored rule no number claims by content (then by one side, then by position), so a rule that did not
change keeps its id and lifetime number: flow evidence stays attributed to it, and its documents do
not move.

Each exported rule carries its lifetime `number` (the low bits of its conntrack mark, what flow
evidence names it by). A numbered rule of the file is the stored rule of that number, whatever its
content; on a control plane where no rule holds it (an empty one), the apply creates the rule with
that very number, so the documents render byte-identically. A number once given and since deleted is
refused: numbers are never reused, so old evidence is never attributed to a new rule.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import yaml
from django.db import transaction

from controlplane import clock
from controlplane.auth.actor import Actor
from controlplane.clock import rfc3339
from controlplane.conditional import version_text
from controlplane.problems import Finding, Problem, ValidationFailed, pointer
from controlplane.strict_json import _check_values, json_loads_strict
from controlplane.validation import Findings, quoted, reject_unknown
from flows.policy_drafts.dryrun import render_dryrun
from flows.policy_drafts.impact import policy_impact
from policy import services as writes
from policy.choices import SourceKind
from policy.models import AddressGroup, PolicyState, Ruleset, Service
from policy.renderer import MAX_RULES as MAX_RULE_NUMBER
from policy.representations import port_entry_data
from policy.validation import (
    MAX_ADDRESS_GROUPS,
    MAX_RULESETS,
    MAX_SERVICES,
    address_group_input,
    ruleset_input,
    service_input,
)

FORMAT_VERSION = 1
FORMATS = ("yaml", "json")
MAX_FILE_BYTES = 32 * 1024 * 1024
IMPACT_DAYS = 7

TOP_KEYS = ("version", "services", "address_groups", "rulesets")
SERVICE_KEYS = ("name", "description", "entries")
GROUP_KEYS = ("name", "description", "members")
RULESET_KEYS = ("name", "description", "enabled", "scope", "rules")
RULE_KEYS = ("number", "description", "sources", "services")
RULE_FIELDS = RULE_KEYS[1:]  # what a plan compares: a numbered rule *is* the stored rule of its number

KINDS = ("service", "address_group", "ruleset")
_LISTS = {"service": "services", "address_group": "address_groups", "ruleset": "rulesets"}


class PolicyFileInvalid(ValidationFailed):
    """Every finding of a policy file, not the API's first fifty: the file is fixed in one pass."""

    MAX_FINDINGS = 10_000


def file_path(json_pointer: str) -> str:
    """A finding's JSON Pointer as a path in the file: `/rulesets/2/rules/0` -> `rulesets[2].rules[0]`."""
    out = ""
    for part in json_pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out or "(file)"


# --- the canonical form: what the file holds, and what the stored policy is ------------------------


def _service_canonical(name: str, description: str, entries) -> dict:
    data: dict = {"name": name}
    if description:
        data["description"] = description
    data["entries"] = [port_entry_data(e.protocol, e.port, e.port_to) for e in entries]
    return data


def _group_canonical(name: str, description: str, members) -> dict:
    data: dict = {"name": name}
    if description:
        data["description"] = description
    data["members"] = list(members)
    return data


def _rule_canonical(number: int | None, description: str, sources: list[dict], services: list[dict]) -> dict:
    data: dict = {}
    if number is not None:
        data["number"] = number
    if description:
        data["description"] = description
    data["sources"] = sources
    data["services"] = services
    return data


def _ruleset_canonical(name: str, description: str, enabled: bool, scope: str, rules: list[dict]) -> dict:
    data: dict = {"name": name}
    if description:
        data["description"] = description
    data.update({"enabled": enabled, "scope": scope, "rules": rules})
    return data


@dataclass
class _StoredObject:
    id: str
    version: str
    data: dict
    rule_ids: list[str] = field(default_factory=list)


@dataclass
class _Stored:
    """The stored policy in canonical form, with what a write needs (ids, versions)."""

    policy_version: int
    objects: dict[str, dict[str, _StoredObject]]  # kind -> name -> object
    next_rule_number: int = 1
    rule_owners: dict[int, str] = field(default_factory=dict)  # a stored rule's number -> its ruleset


def _stored_load() -> _Stored:
    """Call under the policy lock (`_locked_policy_version`), so that every read sees one state."""
    state = PolicyState.objects.filter(id=1).first()
    services = {}
    service_names = {}
    for service in Service.objects.prefetch_related("entries").order_by("name"):
        service_names[service.id] = service.name
        services[service.name] = _StoredObject(
            str(service.id),
            version_text(service.version),
            _service_canonical(service.name, service.description, service.entries.all()),
        )
    groups = {}
    group_names = {}
    for group in AddressGroup.objects.order_by("name"):
        group_names[group.id] = group.name
        groups[group.name] = _StoredObject(
            str(group.id),
            version_text(group.version),
            _group_canonical(group.name, group.description, group.members),
        )
    rulesets = {}
    rule_owners: dict[int, str] = {}
    rules_prefetch = ("rules__sources", "rules__services")
    for ruleset in Ruleset.objects.prefetch_related("rules", *rules_prefetch).order_by("name"):
        rules, rule_ids = [], []
        for rule in sorted(ruleset.rules.all(), key=lambda r: r.position):
            sources: list[dict] = []
            for source in rule.sources.all():
                if source.kind == SourceKind.SELECTOR:
                    sources.append({"selector": source.selector})
                elif source.kind == SourceKind.ADDRESS_GROUP:
                    sources.append({"address_group": group_names[source.address_group_id]})
                else:
                    sources.append({"any": True})
            refs = [
                {"service": service_names[ref.service_id]}
                if ref.service_id is not None
                else port_entry_data(ref.protocol, ref.port, ref.port_to)
                for ref in rule.services.all()
            ]
            rules.append(_rule_canonical(rule.number, rule.description, sources, refs))
            rule_ids.append(str(rule.id))
            rule_owners[rule.number] = ruleset.name
        rulesets[ruleset.name] = _StoredObject(
            str(ruleset.id),
            version_text(ruleset.version),
            _ruleset_canonical(ruleset.name, ruleset.description, ruleset.enabled, ruleset.scope, rules),
            rule_ids,
        )
    return _Stored(
        policy_version=state.version if state else 1,
        objects={"service": services, "address_group": groups, "ruleset": rulesets},
        next_rule_number=state.next_rule_number if state else 1,
        rule_owners=rule_owners,
    )


def _locked_policy_version() -> int:
    """Lock the policy state row until the transaction ends: every policy write locks it first, so
    nothing commits a policy change while it is held."""
    state = PolicyState.objects.select_for_update().filter(id=1).first()
    return state.version if state else 1


def _document(stored: _Stored) -> dict:
    return {
        "version": FORMAT_VERSION,
        **{_LISTS[kind]: [o.data for o in stored.objects[kind].values()] for kind in KINDS},
    }


def policy_export_data() -> dict:
    with transaction.atomic():
        _locked_policy_version()
        return _document(_stored_load())


def policy_export(*, format: str = "yaml") -> str:  # noqa: A002  (the command's option name)
    """The stored policy as the file's text: sorted by name, no ids, versions or timestamps."""
    if format not in FORMATS:
        raise Problem("malformed-request", f"The format is one of {', '.join(FORMATS)}.")
    return dump(policy_export_data(), format=format)


def dump(data: dict, *, format: str) -> str:  # noqa: A002
    if format == "json":
        return json.dumps(data, indent=2) + "\n"
    # ASCII only (other characters escaped): the text is safe to print on a terminal as it is, and
    # bytes survive any tool that would normalise them.
    return yaml.dump(
        data, Dumper=_Dumper, sort_keys=False, allow_unicode=False, default_flow_style=False, width=4096
    )


class _Dumper(yaml.SafeDumper):
    """Lists indented under their key, as most YAML in review is written."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)


# --- reading a file -----------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """YAML for a policy file: string keys, no key given twice (YAML keeps the last, silently), and
    no aliases (a policy needs none; they could multiply a small file into a huge one)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not admitted in a policy file", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                raise yaml.constructor.ConstructorError(
                    None, None, "a key must be a string", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {quoted(key)} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def policy_file_load(*, text: str | bytes, source: str) -> Any:
    """The file's data: JSON when `source` ends in .json, else YAML (a JSON file is YAML too).
    A syntax error is one problem naming the line and column."""
    if len(text) > MAX_FILE_BYTES:
        raise Problem("malformed-request", f"{source} is larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB.")
    if source.endswith(".json"):
        return json_loads_strict(text, what=source)
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise Problem("malformed-request", f"{source} is not UTF-8 text.") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506  (_Loader is a SafeLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = error.problem or error.context or "not valid YAML"
        raise Problem("malformed-request", f"{source} is not valid YAML{where}: {problem}.") from None
    except yaml.YAMLError as error:
        raise Problem("malformed-request", f"{source} is not valid YAML: {error}.") from None
    except RecursionError:
        raise Problem("malformed-request", f"{source} is nested too deeply.") from None
    _check_values(data, source)
    return data


# --- the desired policy ---------------------------------------------------------------------------


@dataclass
class _Desired:
    objects: dict[str, dict[str, dict]]  # kind -> name -> canonical data
    paths: dict[str, dict[str, str]]  # kind -> name -> its pointer in the file


def _prefixed(error: ValidationFailed, base: str) -> list[Finding]:
    return [Finding(base + f.path, f.rule, f.message) for f in error.findings]


def _items(data: Mapping, key: str, maximum: int, findings: Findings) -> list:
    # Required, even empty: with --prune a list left out (a truncated file) would delete every object
    # of its kind.
    if key not in data:
        findings.add(pointer(key), "required", f"{key} is required ([] for none).")
        return []
    items = data[key]
    if not isinstance(items, list):
        findings.add(pointer(key), "type", f"{key} must be a list ([] for none).")
        return []
    if len(items) > maximum:
        findings.add(pointer(key), "too-many", f"{key} may have at most {maximum} items.")
        return []
    return items


def _unique_name(kind: str, name: str, path: str, desired: _Desired, findings: Findings) -> None:
    if name in desired.paths[kind]:
        first = file_path(desired.paths[kind][name])
        findings.add(
            path + "/name", "duplicate-name", f"The name {quoted(name)} is given twice (also {first})."
        )
    else:
        desired.paths[kind][name] = path


def _references(item: Any) -> list[tuple[str, str, str]]:
    """(pointer within the ruleset, kind, name) of each reference of a ruleset's rules, read from the
    raw item so that a rule with other findings has its references checked too."""
    found = []
    rules = item.get("rules") if isinstance(item, Mapping) else None
    for i, rule in enumerate(rules if isinstance(rules, list) else []):
        if not isinstance(rule, Mapping):
            continue
        for key, kind in (("sources", "address_group"), ("services", "service")):
            entries = rule.get(key)
            for j, entry in enumerate(entries if isinstance(entries, list) else []):
                if isinstance(entry, Mapping) and len(entry) == 1 and isinstance(entry.get(kind), str):
                    found.append((pointer("rules", i, key, j, kind), kind, entry[kind]))
    return found


def _rule_numbers(item: Any, base: str, seen: dict[int, str], findings: Findings) -> list[int | None]:
    """The `number` of each rule of a ruleset's raw item (None where absent or not valid), checked for
    what needs no stored policy: an int the mark can hold, given once in the file (`seen`: number ->
    its pointer, across rulesets)."""
    rules = item.get("rules") if isinstance(item, Mapping) else None
    numbers: list[int | None] = []
    for index, rule in enumerate(rules if isinstance(rules, list) else []):
        number = rule.get("number") if isinstance(rule, Mapping) else None
        path = base + pointer("rules", index, "number")
        if number is not None and (isinstance(number, bool) or not isinstance(number, int)):
            findings.add(path, "type", "number must be an integer: the rule's lifetime number, as exported.")
            number = None
        elif number is not None and not 1 <= number <= MAX_RULE_NUMBER:
            findings.add(path, "out-of-range", f"number must be 1-{MAX_RULE_NUMBER} (the mark's 24 bits).")
            number = None
        elif number is not None and number in seen:
            findings.add(
                path,
                "duplicate-number",
                f"The number {number} is given twice (also {file_path(seen[number])}): a number is one rule.",
            )
            number = None
        elif number is not None:
            seen[number] = path
        numbers.append(number)
    return numbers


def _parse(data: Any, findings: Findings) -> tuple[_Desired, list]:
    """The file's objects in canonical form (references still names), every finding collected."""
    desired = _Desired({kind: {} for kind in KINDS}, {kind: {} for kind in KINDS})
    ruleset_specs: list = []
    if not isinstance(data, Mapping):
        findings.add(
            "", "type", "A policy file is a mapping with version, services, address_groups, rulesets."
        )
        return desired, ruleset_specs
    reject_unknown(data, TOP_KEYS, findings)
    if data.get("version") != FORMAT_VERSION or isinstance(data.get("version"), bool):
        findings.add(
            "/version",
            "format-version",
            f"version must be {FORMAT_VERSION}: the format of this file (manage.py policy export writes it).",
        )
    parsers: tuple[tuple[str, Callable, tuple[str, ...], int], ...] = (
        ("service", service_input, SERVICE_KEYS, MAX_SERVICES),
        ("address_group", address_group_input, GROUP_KEYS, MAX_ADDRESS_GROUPS),
        ("ruleset", ruleset_input, RULESET_KEYS, MAX_RULESETS),
    )
    numbers_seen: dict[int, str] = {}
    for kind, parse, keys, maximum in parsers:
        for index, item in enumerate(_items(data, _LISTS[kind], maximum, findings)):
            base = pointer(_LISTS[kind], index)
            before = len(findings.items)
            name = item.get("name") if isinstance(item, Mapping) else None
            if isinstance(name, str) and name:
                _unique_name(kind, name, base, desired, findings)
            if isinstance(item, Mapping):
                # The API also accepts what a read returns (id, version, ...); a file names no id.
                reject_unknown(item, keys, findings, base)
                if kind == "ruleset" and isinstance(item.get("rules"), list):
                    for r_index, rule in enumerate(item["rules"]):
                        if isinstance(rule, Mapping):
                            reject_unknown(rule, RULE_KEYS, findings, base + pointer("rules", r_index))
            try:
                spec = parse(item)
            except ValidationFailed as error:
                findings.extend(_prefixed(error, base))
                spec = None
            if kind == "ruleset":
                numbers = _rule_numbers(item, base, numbers_seen, findings)
                name = item.get("name") if isinstance(item, Mapping) else None
                ruleset_specs.append((base, name, spec, _references(item), numbers))
            if spec is None or len(findings.items) > before:
                continue
            if kind == "service":
                desired.objects[kind][spec.name] = _service_canonical(
                    spec.name, spec.description, spec.entries
                )
            elif kind == "address_group":
                desired.objects[kind][spec.name] = _group_canonical(spec.name, spec.description, spec.members)
    return desired, ruleset_specs


def _resolve_rulesets(
    desired: _Desired, ruleset_specs: list, stored: _Stored, prune: bool, findings: Findings
) -> None:
    """Rulesets in canonical form; each reference names an object of the file, or without --prune
    a stored one (which the apply keeps)."""
    names = {
        kind: set(desired.objects[kind]) | (set() if prune else set(stored.objects[kind]))
        for kind in ("service", "address_group")
    }
    where = "in the file" if prune else "in the file or stored"
    what = {"service": "service", "address_group": "address group"}
    for base, ruleset_name, spec, references, numbers in ruleset_specs:
        for path, kind, name in references:
            if name not in names[kind]:
                findings.add(
                    base + path, "unknown-reference", f"no {what[kind]} named {quoted(name)} {where}."
                )
        _check_numbers(base, ruleset_name, numbers, stored, findings)
        if spec is None:
            continue
        rules = []
        for rule, number in zip(spec.rules, numbers, strict=True):
            sources: list[dict] = []
            for source in rule.sources:
                if source.kind == SourceKind.SELECTOR:
                    sources.append({"selector": source.selector})
                elif source.kind == SourceKind.ADDRESS_GROUP:
                    sources.append({"address_group": source.reference})
                else:
                    sources.append({"any": True})
            refs = [
                port_entry_data(ref.entry.protocol, ref.entry.port, ref.entry.port_to)
                if ref.entry is not None
                else {"service": ref.reference}
                for ref in rule.services
            ]
            rules.append(_rule_canonical(number, rule.description, sources, refs))
        desired.objects["ruleset"][spec.name] = _ruleset_canonical(
            spec.name, spec.description, spec.enabled, spec.scope, rules
        )


def _check_numbers(
    base: str, ruleset_name: Any, numbers: list[int | None], stored: _Stored, findings: Findings
) -> None:
    """A number of the file names its stored rule, which must be of this ruleset, or one never given."""
    for index, number in enumerate(numbers):
        if number is None:
            continue
        path = base + pointer("rules", index, "number")
        owner = stored.rule_owners.get(number)
        if owner is not None and owner != ruleset_name:
            findings.add(
                path,
                "rule-of-another-ruleset",
                f"rule {number} belongs to ruleset {quoted(owner)}; a rule cannot move between rulesets: "
                "remove its number to create a new rule there.",
            )
        elif owner is None and number < stored.next_rule_number:
            findings.add(
                path,
                "number-given",
                f"number {number} was given to a rule since deleted; numbers are never reused, so flow "
                "evidence of the old rule is never attributed to a new one: remove `number` to create "
                "a new rule.",
            )


# --- the plan -----------------------------------------------------------------------------------


def _content(rule: dict) -> dict:
    return {key: value for key, value in rule.items() if key != "number"}


def _match_rules(old: list[dict], new: list[dict]) -> list[int | None]:
    """For each new rule, the stored rule it keeps (its index) or None for a new one. A numbered rule
    is the stored rule of its number (or new, with that number). An unnumbered one takes, among the
    stored rules no number of the file claims: an identical one not taken yet; else one with the same
    sources or the same services (an edit of one side); else the one at the same position, if free."""
    matched: list[int | None] = [None] * len(new)
    by_number = {rule["number"]: j for j, rule in enumerate(old)}
    for i, rule in enumerate(new):
        if "number" in rule:
            matched[i] = by_number.get(rule["number"])
    claimed = {rule["number"] for rule in new if "number" in rule}
    taken = {j for j, rule in enumerate(old) if rule["number"] in claimed}

    def match(alike) -> None:
        for i, rule in enumerate(new):
            if matched[i] is not None or "number" in rule:
                continue
            for j, candidate in enumerate(old):
                if j not in taken and alike(i, rule, j, candidate):
                    matched[i] = j
                    taken.add(j)
                    break

    match(lambda i, rule, j, candidate: _content(candidate) == rule)
    match(
        lambda i, rule, j, candidate: (
            candidate["sources"] == rule["sources"] or candidate["services"] == rule["services"]
        )
    )
    match(lambda i, rule, j, candidate: i == j)
    return matched


def _rule_changes(old: list[dict], new: list[dict], matched: list[int | None]) -> list[dict]:
    changes: list[dict] = []
    for i, j in enumerate(matched):
        if j is None:
            changes.append({"field": f"rules[{i}]", "action": "add", "new": new[i]})
            continue
        for key in RULE_FIELDS:
            before, after = old[j].get(key, ""), new[i].get(key, "")
            if before != after:
                changes.append(
                    {"field": f"rules[{i}].{key}", "action": "change", "old": before, "new": after}
                )
    kept = {j for j in matched if j is not None}
    for j, rule in enumerate(old):
        if j not in kept:
            changes.append({"field": f"rules[{j}]", "action": "remove", "old": rule})  # its stored place
    order = [j for j in matched if j is not None]
    if order != sorted(order):
        changes.append(
            {
                "field": "rules",
                "action": "reorder",
                "old": sorted(order),
                "new": order,
            }
        )
    return changes


def _field_changes(kind: str, old: dict, new: dict, matched: list[int | None] | None) -> list[dict]:
    changes = []
    keys = {"service": SERVICE_KEYS, "address_group": GROUP_KEYS, "ruleset": RULESET_KEYS}[kind]
    for key in keys:
        if key == "name":
            continue
        before, after = old.get(key, ""), new.get(key, "")
        if key == "rules":
            assert matched is not None  # noqa: S101
            changes.extend(_rule_changes(old["rules"], new["rules"], matched))
        elif before != after:
            changes.append({"field": key, "action": "change", "old": before, "new": after})
    return changes


@dataclass
class _Step:
    kind: str
    action: str  # create, change, delete
    name: str
    fields: list[dict]
    body: dict | None = None  # the API's write body (create, change)
    stored: _StoredObject | None = None  # change, delete
    rule_numbers: dict[tuple[str, int], int] = field(default_factory=dict)  # created rules' numbers


@dataclass
class _Plan:
    policy_version: int
    steps: list[_Step]
    kept: list[tuple[str, str]]
    dryrun_rulesets: list[dict]
    services: list[dict]
    groups: list[dict]
    ruleset_paths: dict[str, str]  # name -> pointer in the file
    rule_numbers: dict[tuple[str, int], int]  # (ruleset name, position) -> a created rule's number


def _ruleset_body(data: dict, rule_ids: list[str | None]) -> dict:
    """The API's body: kept rules by id; numbers go beside it (`_created_numbers`), the API ignores
    a body's."""
    rules = [
        {**_content(rule), "id": rule_id} if rule_id else _content(rule)
        for rule, rule_id in zip(data["rules"], rule_ids, strict=True)
    ]
    return {**data, "rules": rules}


def _created_numbers(data: dict, rule_ids: list[str | None]) -> dict[tuple[str, int], int]:
    return {
        (data["name"], position): rule["number"]
        for position, (rule, rule_id) in enumerate(zip(data["rules"], rule_ids, strict=True))
        if rule_id is None and "number" in rule
    }


def _make_plan(data: Any, *, prune: bool) -> _Plan:
    """The steps from the stored policy to the file's; call under the policy lock."""
    findings = Findings()
    desired, ruleset_specs = _parse(data, findings)
    stored = _stored_load()
    _resolve_rulesets(desired, ruleset_specs, stored, prune, findings)
    if findings:
        # The file's own key check and the API's parser may both refuse an unknown key: once is enough.
        raise PolicyFileInvalid(list(dict.fromkeys(findings.items)))
    steps: list[_Step] = []
    kept: list[tuple[str, str]] = []
    kept_rulesets: list[dict] = []
    for kind in KINDS:
        wanted, current = desired.objects[kind], stored.objects[kind]
        for name in sorted(wanted.keys() | current.keys()):
            new, old = wanted.get(name), current.get(name)
            if old is None:
                assert new is not None  # noqa: S101
                body, numbers = new, {}
                if kind == "ruleset":
                    body = _ruleset_body(new, [None] * len(new["rules"]))
                    numbers = _created_numbers(new, [None] * len(new["rules"]))
                fields = [{"field": k, "action": "set", "new": v} for k, v in new.items() if k != "name"]
                steps.append(_Step(kind, "create", name, fields, body, rule_numbers=numbers))
            elif new is None:
                if prune:
                    steps.append(_Step(kind, "delete", name, [], stored=old))
                else:
                    kept.append((kind, name))
                    if kind == "ruleset":
                        kept_rulesets.append(_ruleset_body(old.data, list(old.rule_ids)))
            else:
                matched = _match_rules(old.data["rules"], new["rules"]) if kind == "ruleset" else None
                fields = _field_changes(kind, old.data, new, matched)
                body, numbers = new, {}
                if kind == "ruleset":
                    assert matched is not None  # noqa: S101
                    ids = [old.rule_ids[j] if j is not None else None for j in matched]
                    body, numbers = _ruleset_body(new, ids), _created_numbers(new, ids)
                if fields:
                    steps.append(_Step(kind, "change", name, fields, body, stored=old, rule_numbers=numbers))
                elif kind == "ruleset":
                    kept_rulesets.append(body)
    # The dry-run numbers new rules in the order the apply creates them: created rulesets, then
    # changed ones, each by name.
    dryrun_rulesets = [s.body for s in steps if s.kind == "ruleset" and s.action == "create"]
    dryrun_rulesets += [s.body for s in steps if s.kind == "ruleset" and s.action == "change"]
    dryrun_rulesets += kept_rulesets
    return _Plan(
        policy_version=stored.policy_version,
        steps=steps,
        kept=kept,
        dryrun_rulesets=[b for b in dryrun_rulesets if b is not None],
        services=list(desired.objects["service"].values()),
        groups=list(desired.objects["address_group"].values()),
        ruleset_paths=desired.paths["ruleset"],
        rule_numbers={key: n for step in steps for key, n in step.rule_numbers.items()},
    )


def _step_data(step: _Step) -> dict:
    return {"action": step.action, "type": step.kind, "name": step.name, "fields": step.fields}


def policy_plan(
    *, data: Any, prune: bool = False, impact_from: str | None = None, impact_to: str | None = None
) -> dict:
    """What applying the file would do, and the policy version it was planned against (what
    `policy_apply` must be given as `expected_version`). Writes nothing."""
    with transaction.atomic():
        _locked_policy_version()
        plan = _make_plan(data, prune=prune)
    answer: dict = {
        "policy_version": version_text(plan.policy_version),
        "prune": prune,
        "changes": [_step_data(s) for s in plan.steps],
        "kept": [{"type": kind, "name": name} for kind, name in plan.kept],
        "render": None,
        "impact": None,
        "warnings": [],
    }
    if not plan.steps:
        return answer
    body = {"rulesets": plan.dryrun_rulesets, "services": plan.services, "address_groups": plan.groups}
    dryrun = render_dryrun(data=body, rule_numbers=plan.rule_numbers)
    answer["render"] = {
        "changed_count": dryrun["changed_count"],
        "unchanged_count": dryrun["unchanged_count"],
    }
    answer["warnings"] = _file_warnings(dryrun["warnings"], plan)
    end = clock.now()
    selection = {
        "from": impact_from or rfc3339(end - timedelta(days=IMPACT_DAYS)),
        "to": impact_to or rfc3339(end),
        "label": [],
        "workload": [],
    }
    impact = policy_impact(data={**body, **selection}, rule_numbers=plan.rule_numbers)
    answer["impact"] = {
        key: impact[key]
        for key in (
            "from",
            "to",
            "keys_classified",
            "newly_refused_summary",
            "newly_admitted_summary",
            "coverage",
        )
    }
    return answer


def _file_warnings(warnings: list[dict], plan: _Plan) -> list[dict]:
    """The dry-run's warnings (pointers into its own body) as pointers into the file, for the rulesets
    the plan creates or changes: the others are not the plan's concern."""
    touched = {s.name for s in plan.steps if s.kind == "ruleset" and s.action != "delete"}
    out = []
    for warning in warnings:
        _, _, index, tail = (warning["path"].split("/", 3) + [""])[:4]
        name = plan.dryrun_rulesets[int(index)]["name"]
        if name in touched and name in plan.ruleset_paths:
            out.append({**warning, "path": plan.ruleset_paths[name] + ("/" + tail if tail else "")})
    return out


def _expected(version: str) -> str:
    return version.strip().strip('"')


def policy_apply(*, actor: Actor, data: Any, prune: bool = False, expected_version: str, source: str) -> dict:
    """Perform the plan of `data` in one transaction through the API's write functions, each write an
    audit event whose detail names `source`; refused, with nothing written, when the policy version is
    not `expected_version` (the policy moved since the plan)."""
    detail = {"source": source, "via": "policy apply"}
    with transaction.atomic():
        current = _locked_policy_version()
        if version_text(current) != _expected(expected_version):
            raise Problem(
                "precondition-failed",
                f"The policy moved since the plan: it is at version {version_text(current)}, the plan was "
                f"made at {quoted(_expected(expected_version))}; plan again.",
                current_version=version_text(current),
            )
        plan = _make_plan(data, prune=prune)
        # The file's numbers for the rules it creates, set aside before any rule is created, so that
        # an unnumbered new rule is numbered past them (as the plan's dry-run numbered it).
        numbers = writes.rule_numbers_claim(requested=plan.rule_numbers)
        by_kind_action: dict[tuple[str, str], list[_Step]] = {}
        for step in plan.steps:
            by_kind_action.setdefault((step.kind, step.action), []).append(step)

        def run(kind: str, action: str) -> None:
            for step in by_kind_action.get((kind, action), []):
                _perform(step, actor=actor, audit_detail=detail, rule_numbers=numbers)

        # Deleted rulesets first (room for new ones, and their references go), then the services and
        # groups the rulesets may name, then rulesets, then the services and groups no longer named.
        run("ruleset", "delete")
        for kind in ("service", "address_group"):
            run(kind, "create")
            run(kind, "change")
        run("ruleset", "create")
        run("ruleset", "change")
        for kind in ("service", "address_group"):
            run(kind, "delete")
        after = PolicyState.objects.filter(id=1).values_list("version", flat=True).first() or 1
    return {
        "applied": len(plan.steps),
        "changes": [_step_data(s) for s in plan.steps],
        "kept": [{"type": kind, "name": name} for kind, name in plan.kept],
        "policy_version_before": version_text(plan.policy_version),
        "policy_version": version_text(after),
    }


_WRITES = {
    ("service", "create"): lambda step, **kw: writes.service_create(data=step.body, **kw),
    ("service", "change"): lambda step, **kw: writes.service_replace(
        service_id=step.stored.id, expected_version=step.stored.version, data=step.body, **kw
    ),
    ("service", "delete"): lambda step, **kw: writes.service_delete(
        service_id=step.stored.id, expected_version=step.stored.version, **kw
    ),
    ("address_group", "create"): lambda step, **kw: writes.address_group_create(data=step.body, **kw),
    ("address_group", "change"): lambda step, **kw: writes.address_group_replace(
        group_id=step.stored.id, expected_version=step.stored.version, data=step.body, **kw
    ),
    ("address_group", "delete"): lambda step, **kw: writes.address_group_delete(
        group_id=step.stored.id, expected_version=step.stored.version, **kw
    ),
    ("ruleset", "create"): lambda step, **kw: writes.ruleset_create(data=step.body, **kw),
    ("ruleset", "change"): lambda step, **kw: writes.ruleset_replace(
        ruleset_id=step.stored.id, expected_version=step.stored.version, data=step.body, **kw
    ),
    ("ruleset", "delete"): lambda step, **kw: writes.ruleset_delete(
        ruleset_id=step.stored.id, expected_version=step.stored.version, **kw
    ),
}


def _perform(step: _Step, *, actor: Actor, audit_detail: dict, rule_numbers: writes.RuleNumbers) -> None:
    """One write; a problem it raises names the object, since the file's paths no longer apply."""
    more = {"rule_numbers": rule_numbers} if step.kind == "ruleset" and step.action != "delete" else {}
    try:
        _WRITES[(step.kind, step.action)](step, actor=actor, audit_detail=audit_detail, **more)
    except ValidationFailed as error:
        raise PolicyFileInvalid(
            [Finding(f"/{_LISTS[step.kind]}/{step.name}{f.path}", f.rule, f.message) for f in error.findings]
        ) from None
    except Problem as problem:
        raise Problem(
            problem.name,
            f"{step.action} {step.kind.replace('_', ' ')} {quoted(step.name)}: {problem.detail}",
        ) from None

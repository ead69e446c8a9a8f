"""A policy file read into the policy it describes, every finding collected: the file is fixed in one
pass. Each object is checked by the API's own parsers (policy/validation.py); references name objects
of the file or, without --prune, stored ones.

A numbered rule of the file is the stored rule of that number, whatever its content, or one created
with that very number where no rule holds it; a number once given and since deleted is refused:
numbers are never reused, so old evidence is never attributed to a new rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.problems import Finding, ValidationFailed, pointer
from controlplane.validation import Findings, quoted, reject_unknown
from flows.policy_drafts.as_code.format import (
    FORMAT_VERSION,
    GROUP_KEYS,
    KINDS,
    LISTS,
    RULE_KEYS,
    RULESET_KEYS,
    SERVICE_KEYS,
    TOP_KEYS,
    StoredPolicy,
    file_path,
    group_canonical,
    rule_canonical,
    ruleset_canonical,
    service_canonical,
)
from policy.choices import SourceKind
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

# The rules a file may hold, all rulesets together. The API's own limits (1,000 rulesets of 500 rules)
# admit twenty times more, but a file is read whole (PyYAML builds every node in Python), then checked,
# compared, rendered for every workload and judged against past traffic rule by rule: this many is read
# and planned within a minute with room to spare (bench/bench_policy_plan.py, docs/benchmarks.md).
MAX_FILE_RULES = 25_000


class PolicyFileInvalid(ValidationFailed):
    """Every finding of a policy file, not the API's first fifty: the file is fixed in one pass."""

    MAX_FINDINGS = 10_000


# --- the desired policy ---------------------------------------------------------------------------


@dataclass
class DesiredPolicy:
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


def _rules_counted(rulesets: list) -> int:
    return sum(
        len(item["rules"])
        for item in rulesets
        if isinstance(item, Mapping) and isinstance(item.get("rules"), list)
    )


def _unique_name(kind: str, name: str, path: str, desired: DesiredPolicy, findings: Findings) -> None:
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
        for key, kind in (
            ("sources", "address_group"),
            ("destinations", "address_group"),
            ("services", "service"),
        ):
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


def file_parse(data: Any, findings: Findings) -> tuple[DesiredPolicy, list]:
    """The file's objects in canonical form (references still names), every finding collected."""
    desired = DesiredPolicy({kind: {} for kind in KINDS}, {kind: {} for kind in KINDS})
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
        items = _items(data, LISTS[kind], maximum, findings)
        if kind == "ruleset" and (rules := _rules_counted(items)) > MAX_FILE_RULES:
            findings.add(
                pointer("rulesets"),
                "too-many",
                f"A policy file holds at most {MAX_FILE_RULES:,} rules in all; this one has {rules:,}.",
            )
            items = []
        for index, item in enumerate(items):
            base = pointer(LISTS[kind], index)
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
                desired.objects[kind][spec.name] = service_canonical(
                    spec.name, spec.description, spec.entries
                )
            elif kind == "address_group":
                desired.objects[kind][spec.name] = group_canonical(spec.name, spec.description, spec.members)
    return desired, ruleset_specs


def file_rulesets_resolve(
    desired: DesiredPolicy, ruleset_specs: list, stored: StoredPolicy, prune: bool, findings: Findings
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
            rules.append(rule_canonical(number, rule.description, sources, refs, rule.action, spec.direction))
        desired.objects["ruleset"][spec.name] = ruleset_canonical(
            spec.name, spec.description, spec.enabled, spec.scope, rules, spec.direction
        )


def _check_numbers(
    base: str, ruleset_name: Any, numbers: list[int | None], stored: StoredPolicy, findings: Findings
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

"""The policy file: the authored policy as one reviewable file, and the stored policy in its form.

The file holds services, address groups and rulesets with their rules, in the shape of the API's write
bodies but naming objects instead of giving their ids, with no versions or timestamps: an export is
sorted by name and deterministic, so two exports of the same policy are byte-identical and a diff in
git shows only real changes. Objects are identified by name (a rename is a delete and a create); the
rules of a ruleset keep their order, which is semantic.

Each exported rule carries its lifetime `number` (the low bits of its conntrack mark, what flow
evidence names it by), so that a file applied to an empty control plane renders byte-identical
documents (parse.py, plan.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import yaml
from django.db import transaction

from controlplane.conditional import version_text
from controlplane.problems import Problem
from controlplane.strict_json import decoded_values_check, json_loads_strict
from controlplane.validation import quoted
from flows.policy_drafts.as_code.yaml_core import CoreConstructor, CoreParser, CoreResolver, aliases_refuse
from policy.choices import SourceKind
from policy.models import AddressGroup, PolicyState, Ruleset, Service
from policy.representations import port_entry_data
from policy.services import policy_lock
from policy.validation import peers_key

FORMAT_VERSION = 1
FORMATS = ("yaml", "json")
# A file is read whole, then checked, planned and applied in one go: this much is read and planned
# within a minute at the densest (bench/bench_policy_plan.py, docs/benchmarks.md); an export of
# MAX_FILE_RULES rules of one source and one service each is under 3 MiB.
MAX_FILE_BYTES = 4 * 1024 * 1024

TOP_KEYS = ("version", "services", "address_groups", "rulesets")
SERVICE_KEYS = ("name", "description", "entries")
GROUP_KEYS = ("name", "description", "members")
RULESET_KEYS = ("name", "description", "enabled", "scope", "direction", "rules")
# A rule has sources (an inbound ruleset's) or destinations (an outbound one's), never both.
RULE_KEYS = ("number", "description", "action", "sources", "destinations", "services")
RULE_FIELDS = RULE_KEYS[1:]  # what a plan compares: a numbered rule *is* the stored rule of its number

KINDS = ("service", "address_group", "ruleset")
LISTS = {"service": "services", "address_group": "address_groups", "ruleset": "rulesets"}


def file_path(json_pointer: str) -> str:
    """A finding's JSON Pointer as a path in the file: `/rulesets/2/rules/0` -> `rulesets[2].rules[0]`."""
    out = ""
    for part in json_pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out or "(file)"


# --- the canonical form: what the file holds, and what the stored policy is ------------------------


def service_canonical(name: str, description: str, entries) -> dict:
    data: dict = {"name": name}
    if description:
        data["description"] = description
    data["entries"] = [port_entry_data(e.protocol, e.port, e.port_to) for e in entries]
    return data


def group_canonical(name: str, description: str, members) -> dict:
    data: dict = {"name": name}
    if description:
        data["description"] = description
    data["members"] = list(members)
    return data


def rule_canonical(
    number: int | None,
    description: str,
    sources: list[dict],
    services: list[dict],
    action: str = "allow",
    direction: str = "inbound",
) -> dict:
    data: dict = {}
    if number is not None:
        data["number"] = number
    if description:
        data["description"] = description
    # Only a deny rule says so: an allow rule's file reads as it did before rules had an action.
    if action != "allow":
        data["action"] = action
    data[peers_key(direction)] = sources
    data["services"] = services
    return data


def ruleset_canonical(
    name: str, description: str, enabled: bool, scope: str, rules: list[dict], direction: str = "inbound"
) -> dict:
    data: dict = {"name": name}
    if description:
        data["description"] = description
    data.update({"enabled": enabled, "scope": scope})
    # Only an outbound ruleset says so: an inbound ruleset's file reads as it did before outbound.
    if direction != "inbound":
        data["direction"] = direction
    data["rules"] = rules
    return data


@dataclass
class StoredObject:
    id: str
    version: str
    data: dict
    rule_ids: list[str] = field(default_factory=list)


@dataclass
class StoredPolicy:
    """The stored policy in canonical form, with what a write needs (ids, versions)."""

    policy_version: int
    objects: dict[str, dict[str, StoredObject]]  # kind -> name -> object
    next_rule_number: int = 1
    rule_owners: dict[int, str] = field(default_factory=dict)  # a stored rule's number -> its ruleset


def stored_policy_load() -> StoredPolicy:
    """Call under the policy lock (`policy_version_lock`), so that every read sees one state."""
    state = PolicyState.objects.filter(id=1).first()
    services = {}
    service_names = {}
    for service in Service.objects.prefetch_related("entries").order_by("name"):
        service_names[service.id] = service.name
        services[service.name] = StoredObject(
            str(service.id),
            version_text(service.version),
            service_canonical(service.name, service.description, service.entries.all()),
        )
    groups = {}
    group_names = {}
    for group in AddressGroup.objects.order_by("name"):
        group_names[group.id] = group.name
        groups[group.name] = StoredObject(
            str(group.id),
            version_text(group.version),
            group_canonical(group.name, group.description, group.members),
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
            rules.append(
                rule_canonical(rule.number, rule.description, sources, refs, rule.action, ruleset.direction)
            )
            rule_ids.append(str(rule.id))
            rule_owners[rule.number] = ruleset.name
        rulesets[ruleset.name] = StoredObject(
            str(ruleset.id),
            version_text(ruleset.version),
            ruleset_canonical(
                ruleset.name, ruleset.description, ruleset.enabled, ruleset.scope, rules, ruleset.direction
            ),
            rule_ids,
        )
    return StoredPolicy(
        policy_version=state.version if state else 1,
        objects={"service": services, "address_group": groups, "ruleset": rulesets},
        next_rule_number=state.next_rule_number if state else 1,
        rule_owners=rule_owners,
    )


def policy_version_lock() -> int:
    """Lock the policy state row until the transaction ends (policy/services.py `policy_lock`) and
    give the policy version it holds."""
    return policy_lock().version


def _document(stored: StoredPolicy) -> dict:
    return {
        "version": FORMAT_VERSION,
        **{LISTS[kind]: [o.data for o in stored.objects[kind].values()] for kind in KINDS},
    }


def policy_export_data() -> dict:
    with transaction.atomic():
        policy_version_lock()
        return _document(stored_policy_load())


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


class _Loader(CoreParser, CoreConstructor, CoreResolver):
    """YAML for a policy file: YAML 1.2's core schema (as_code/yaml_core.py), string keys, no key given
    twice (YAML keeps the last, silently), and no aliases (a policy needs none; they could multiply a
    small file into a huge one)."""

    def __init__(self, stream):
        CoreParser.__init__(self, stream)
        CoreConstructor.__init__(self)
        CoreResolver.__init__(self)

    def construct_document(self, node):
        aliases_refuse(node)
        return super().construct_document(node)

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
        data = yaml.load(text, Loader=_Loader)  # noqa: S506  (_Loader constructs the core schema alone)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = error.problem or error.context or "not valid YAML"
        raise Problem("malformed-request", f"{source} is not valid YAML{where}: {problem}.") from None
    except yaml.YAMLError as error:
        raise Problem("malformed-request", f"{source} is not valid YAML: {error}.") from None
    except RecursionError:
        raise Problem("malformed-request", f"{source} is nested too deeply.") from None
    decoded_values_check(data, source)
    return data

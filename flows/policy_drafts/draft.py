"""A draft policy, parsed once: the body of a render dry-run (`rulesets`, the complete hypothetical set;
`services` and `address_groups`, which replace or add objects by name) as the renderer's inputs, with
the fleet and the policy in force now loaded once beside it. The render dry-run, the impact over past
traffic and a policy file's plan all judge this one value. Nothing here writes."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.collection_pause import without_collection
from controlplane.problems import Finding, ValidationFailed, pointer
from controlplane.validation import Findings, quoted, reject_unknown
from fleet.rendering import fleet_load
from policy.choices import SourceKind
from policy.grammar import parse_selector
from policy.models import AddressGroup, PolicyState, Rule, Service
from policy.render_inputs import (
    AddressGroupInput,
    FleetIndex,
    PortEntry,
    RuleInput,
    RulesetInput,
    SourceInput,
    WorkloadInput,
    refuses_everything,
)
from policy.selectors import PolicyInputs, policy_inputs_load
from policy.validation import RulesetSpec, address_group_input, ruleset_input, service_input

DRAFT_KEYS = frozenset({"rulesets", "services", "address_groups"})


@dataclass(frozen=True)
class InForce:
    """The fleet and the policy in force now, loaded once: what a draft, or a stored flow key, is
    judged against (selectors resolve to the fleet's addresses now, as in the tables)."""

    fleet: FleetIndex
    workloads: Mapping[str, WorkloadInput]  # by id
    policy: PolicyInputs


def in_force_load() -> InForce:
    fleet, workloads = fleet_load()
    return InForce(fleet=fleet, workloads=workloads, policy=policy_inputs_load())


@dataclass(frozen=True)
class Draft:
    """A draft as the renderer's inputs (`policy`), the body's rulesets as parsed (`specs`, whose
    positions the warnings point at), and what it is judged against (`in_force`)."""

    specs: tuple[RulesetSpec, ...]
    policy: PolicyInputs
    in_force: InForce

    def warnings(self) -> list[dict]:
        """The draft's scopes and source selectors that match no workload now, and its deny rules that
        refuse everything."""
        return unmatched_selectors(self.specs, self.in_force.fleet) + deny_everything(self.specs, self.policy)


@without_collection
def draft_parse(
    *,
    data: Mapping[str, Any],
    findings: Findings | None = None,
    more_keys: frozenset[str] = frozenset(),
    rule_numbers: Mapping[tuple[str, int], int] | None = None,
) -> Draft:
    """The draft of a body, then the fleet and the policy in force now. `more_keys` are the caller's
    own members of the body, whose findings are in `findings` already: every finding is raised
    together, before anything is loaded. `rule_numbers` (internal: a body's `number` is ignored) gives
    new rules, by ruleset name and position, the numbers an apply will create them with."""
    findings = findings if findings is not None else Findings()
    reject_unknown(data, DRAFT_KEYS | more_keys, findings)
    if "rulesets" not in data:
        findings.add(
            "/rulesets", "required", "rulesets is required: the complete hypothetical set of rulesets."
        )
    specs = _parse_list(data, "rulesets", ruleset_input, findings)
    services = _parse_list(data, "services", service_input, findings)
    groups = _parse_list(data, "address_groups", address_group_input, findings)
    findings.raise_if_any()
    catalogue = _Catalogue(services, groups)
    policy = PolicyInputs(
        rulesets=tuple(_hypothetical_rulesets(specs, catalogue, findings, rule_numbers or {})),
        groups=catalogue.group_inputs,
    )
    findings.raise_if_any()
    return Draft(specs=tuple(specs), policy=policy, in_force=in_force_load())


def _prefixed(error: ValidationFailed, base: str) -> list[Finding]:
    return [Finding(base + f.path, f.rule, f.message) for f in error.findings]


def _parse_list(data, key, parse, findings: Findings) -> list:
    items = data.get(key, [])
    if not isinstance(items, list):
        findings.add(pointer(key), "type", f"{key} must be a list.")
        return []
    parsed = []
    for index, item in enumerate(items):
        try:
            parsed.append(parse(item))
        except ValidationFailed as error:
            findings.extend(_prefixed(error, pointer(key, index)))
    return parsed


class _Catalogue:
    """Services and address groups as the hypothetical policy sees them: its own, by name, over the
    stored ones (by id or name)."""

    def __init__(self, services, groups):
        self.services = {
            s.name: tuple(PortEntry(e.protocol, e.port, e.port_to) for e in s.entries) for s in services
        }
        # Groups are known to the renderer by name (policy/selectors.py): the body's replace the
        # stored ones of the same name.
        stored_groups = list(AddressGroup.objects.all())
        self.group_inputs = {
            g.name: AddressGroupInput(g.name, g.name, tuple(g.members)) for g in stored_groups
        }
        self.group_inputs.update({g.name: AddressGroupInput(g.name, g.name, g.members) for g in groups})
        self._name_of_id = {str(g.id): g.name for g in stored_groups}

    def service_entries(self, reference: str, findings: Findings, path: str):
        if reference in self.services:
            return self.services[reference]
        query = {"id": uuid.UUID(reference)} if _is_uuid(reference) else {"name": reference}
        service = Service.objects.filter(**query).prefetch_related("entries").first()
        if service is None:
            findings.add(path, "unknown-reference", f"No service {quoted(reference)}.")
            return ()
        if service.name in self.services:
            return self.services[service.name]
        return tuple(PortEntry(e.protocol, e.port, e.port_to) for e in service.entries.all())

    def group_id(self, reference: str, findings: Findings, path: str) -> str:
        name = self._name_of_id.get(reference, reference)
        if name in self.group_inputs:
            return name
        findings.add(path, "unknown-reference", f"No address group {quoted(reference)}.")
        return reference


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


class _RuleNumbers:
    """Lifetime rule numbers for a hypothetical policy: a stored rule keeps its own (so an unchanged
    rule renders identically); a new rule the caller gives a number (`requested`, by ruleset name and
    position: policy as code) gets it; another new rule, or a stored one named twice, gets one of the
    numbers the next rules would be given, past the requested ones (as rule_numbers_claim leaves
    them)."""

    def __init__(self, requested: Mapping[tuple[str, int], int]):
        self.stored = {str(rule_id): number for rule_id, number in Rule.objects.values_list("id", "number")}
        state = PolicyState.objects.filter(id=1).first()
        self.next = max([state.next_rule_number if state else 1, *(n + 1 for n in requested.values())])
        self.requested = requested
        self.used: set[int] = set(requested.values())

    def number_for(self, rule_id: str | None, ruleset_name: str, position: int) -> int:
        if not rule_id and (ruleset_name, position) in self.requested:
            return self.requested[(ruleset_name, position)]
        number = self.stored.get(rule_id) if rule_id else None
        if number is None or number in self.used:
            number, self.next = self.next, self.next + 1
        self.used.add(number)
        return number


def _hypothetical_rulesets(
    specs, catalogue: _Catalogue, findings: Findings, rule_numbers: Mapping[tuple[str, int], int]
) -> list[RulesetInput]:
    numbers = _RuleNumbers(rule_numbers)
    rulesets = []
    for r_index, spec in enumerate(specs):
        rules = []
        for position, rule in enumerate(spec.rules):
            sources = []
            for source in rule.sources:
                path = pointer("rulesets", r_index) + source.path
                if source.kind == SourceKind.SELECTOR:
                    sources.append(SourceInput(SourceKind.SELECTOR, selector=parse_selector(source.selector)))
                elif source.kind == SourceKind.ADDRESS_GROUP:
                    sources.append(
                        SourceInput(
                            SourceKind.ADDRESS_GROUP,
                            address_group_id=catalogue.group_id(
                                source.reference, findings, path + "/address_group"
                            ),
                        )
                    )
                else:
                    sources.append(SourceInput(SourceKind.ANY))
            entries = []
            for ref in rule.services:
                path = pointer("rulesets", r_index) + ref.path
                if ref.entry is not None:
                    entries.append(PortEntry(ref.entry.protocol, ref.entry.port, ref.entry.port_to))
                else:
                    entries.extend(catalogue.service_entries(ref.reference, findings, path + "/service"))
            rules.append(
                RuleInput(
                    id=rule.id or f"new:{spec.name}:{position}",
                    position=position,
                    description=rule.description,
                    sources=tuple(sources),
                    entries=tuple(dict.fromkeys(entries)),
                    number=numbers.number_for(rule.id, spec.name, position),
                    action=rule.action,
                )
            )
        if spec.enabled:
            rulesets.append(
                RulesetInput(
                    id=f"hypothetical:{spec.name}",
                    name=spec.name,
                    scope=parse_selector(spec.scope),
                    rules=tuple(rules),
                    direction=spec.direction,
                )
            )
    return rulesets


def deny_everything(specs, policy: PolicyInputs) -> list[dict]:
    """A deny rule from `any` source on every service is allowed, but it refuses every new connection
    the workloads of its scope receive: the one rule an operator most likely did not mean."""
    index = {spec.name: r_index for r_index, spec in enumerate(specs)}
    flagged = []
    for ruleset in policy.rulesets:
        for rule in ruleset.rules:
            if refuses_everything(rule):
                scope = str(ruleset.scope) or "every workload"
                flagged.append(
                    {
                        "path": pointer("rulesets", index[ruleset.name], "rules", rule.position),
                        "rule": "deny-refuses-everything",
                        "message": f"This deny rule refuses every connection the workloads of {quoted(scope)} "
                        + (
                            "open, to any destination on every service."
                            if ruleset.direction == "outbound"
                            else "receive, from any source on every service."
                        ),
                    }
                )
    return flagged


def unmatched_selectors(specs, fleet) -> list[dict]:
    flagged = []
    for r_index, spec in enumerate(specs):
        checks = [(pointer("rulesets", r_index, "scope"), spec.scope)]
        for rule in spec.rules:
            for source in rule.sources:
                if source.kind == "selector":
                    checks.append((pointer("rulesets", r_index) + source.path + "/selector", source.selector))
        for path, text in checks:
            if not fleet.positions_matching(parse_selector(text)):
                flagged.append(
                    {
                        "path": path,
                        "rule": "selector-matches-nothing",
                        "message": f"{quoted(text)} matches no workload now.",
                    }
                )
    return flagged

"""The JSON shape of policy objects, shared by the API and the command line."""

from __future__ import annotations

from controlplane.clock import rfc3339
from controlplane.conditional import version_text
from policy.choices import SourceKind
from policy.models import AddressGroup, Rule, RuleService, Ruleset, RuleSource, Service
from policy.validation import peers_key


def port_entry_data(protocol: str, port: int | None, port_to: int | None) -> dict:
    data: dict = {"protocol": protocol}
    if port is not None:
        data["port"] = port
    if port_to is not None:
        data["port_to"] = port_to
    return data


def _stamps(obj) -> dict:
    return {
        "version": version_text(obj.version),
        "created_at": rfc3339(obj.created_at),
        "updated_at": rfc3339(obj.updated_at),
    }


def service_data(service: Service) -> dict:
    return {
        "id": str(service.id),
        "name": service.name,
        "description": service.description,
        "entries": [port_entry_data(e.protocol, e.port, e.port_to) for e in service.entries.all()],
        **_stamps(service),
    }


def address_group_data(group: AddressGroup) -> dict:
    return {
        "id": str(group.id),
        "name": group.name,
        "description": group.description,
        "members": list(group.members),
        **_stamps(group),
    }


def _source_data(source: RuleSource) -> dict:
    if source.kind == SourceKind.SELECTOR:
        return {"selector": source.selector}
    if source.kind == SourceKind.ADDRESS_GROUP:
        return {"address_group": str(source.address_group_id)}
    return {"any": True}


def _service_ref_data(ref: RuleService) -> dict:
    if ref.service_id is not None:
        return {"service": str(ref.service_id)}
    return port_entry_data(ref.protocol, ref.port, ref.port_to)


def rule_data(rule: Rule, direction: str | None = None) -> dict:
    """A rule; its peers are `sources`, or `destinations` in an outbound ruleset (`direction`: its
    ruleset's, when the caller has it)."""
    direction = direction or rule.ruleset.direction
    return {
        "id": str(rule.id),
        "number": rule.number,
        "description": rule.description,
        "action": rule.action,
        peers_key(direction): [_source_data(s) for s in rule.sources.all()],
        "services": [_service_ref_data(s) for s in rule.services.all()],
        **_stamps(rule),
    }


def ruleset_data(ruleset: Ruleset) -> dict:
    return {
        "id": str(ruleset.id),
        "name": ruleset.name,
        "description": ruleset.description,
        "enabled": ruleset.enabled,
        "scope": ruleset.scope,
        "direction": ruleset.direction,
        "rules": [rule_data(r, ruleset.direction) for r in ruleset.rules.all()],
        **_stamps(ruleset),
    }

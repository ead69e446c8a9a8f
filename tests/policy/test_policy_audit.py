"""The audit events of the twelve policy writes, field by field: create, replace and delete of a
service, an address group, a ruleset and a rule."""

from controlplane.auth.actor import CLI_ACTOR
from controlplane.models import AuditEvent
from policy import services


def test_each_policy_write_records_its_action_object_versions_and_detail(db):
    rule_body = {"description": "any", "sources": [{"any": True}], "services": [{"protocol": "icmp"}]}
    service = services.service_create(
        actor=CLI_ACTOR, data={"name": "web", "entries": [{"protocol": "icmp"}]}
    )
    services.service_replace(
        actor=CLI_ACTOR,
        service_id=str(service.id),
        expected_version="1",
        data={"name": "web2", "entries": [{"protocol": "icmp"}]},
    )
    services.service_delete(actor=CLI_ACTOR, service_id=str(service.id), expected_version="2")
    group = services.address_group_create(
        actor=CLI_ACTOR, data={"name": "office", "members": ["10.1.0.0/16"]}
    )
    services.address_group_replace(
        actor=CLI_ACTOR,
        group_id=str(group.id),
        expected_version="1",
        data={"name": "office2", "members": ["10.2.0.0/16"]},
    )
    services.address_group_delete(actor=CLI_ACTOR, group_id=str(group.id), expected_version="2")
    ruleset = services.ruleset_create(
        actor=CLI_ACTOR, data={"name": "front", "scope": "tier=web", "rules": [rule_body]}
    )
    services.ruleset_replace(
        actor=CLI_ACTOR,
        ruleset_id=str(ruleset.id),
        expected_version="1",
        data={"name": "front2", "scope": "tier=web", "rules": [rule_body, rule_body]},
    )
    rule = services.rule_add(actor=CLI_ACTOR, ruleset_id=str(ruleset.id), data=rule_body)
    rv = rule.version
    services.rule_replace(
        actor=CLI_ACTOR,
        ruleset_id=str(ruleset.id),
        rule_id=str(rule.id),
        expected_version=str(rv),
        data={**rule_body, "description": "still any"},
    )
    services.rule_delete(
        actor=CLI_ACTOR, ruleset_id=str(ruleset.id), rule_id=str(rule.id), expected_version=str(rv + 1)
    )
    ruleset.refresh_from_db()
    services.ruleset_delete(
        actor=CLI_ACTOR, ruleset_id=str(ruleset.id), expected_version=str(ruleset.version)
    )

    s, g, rs, r = str(service.id), str(group.id), str(ruleset.id), str(rule.id)
    v = ruleset.version
    events = AuditEvent.objects.order_by("at", "id")
    assert [
        (
            e.actor_kind,
            e.actor,
            e.actor_token_id,
            e.action,
            e.object_type,
            e.object_id,
            e.object_name,
            e.version_before,
            e.version_after,
            e.detail,
        )
        for e in events
    ] == [
        ("cli", CLI_ACTOR.label, None, "service.create", "service", s, "web", "", "1", {}),
        ("cli", CLI_ACTOR.label, None, "service.replace", "service", s, "web2", "1", "2", {}),
        ("cli", CLI_ACTOR.label, None, "service.delete", "service", s, "web2", "2", "", {}),
        ("cli", CLI_ACTOR.label, None, "address_group.create", "address_group", g, "office", "", "1", {}),
        ("cli", CLI_ACTOR.label, None, "address_group.replace", "address_group", g, "office2", "1", "2", {}),
        ("cli", CLI_ACTOR.label, None, "address_group.delete", "address_group", g, "office2", "2", "", {}),
        ("cli", CLI_ACTOR.label, None, "ruleset.create", "ruleset", rs, "front", "", "1", {"rules": 1}),
        ("cli", CLI_ACTOR.label, None, "ruleset.replace", "ruleset", rs, "front2", "1", "2", {"rules": 2}),
        ("cli", CLI_ACTOR.label, None, "rule.create", "rule", r, "", "", str(rv), {"ruleset_id": rs}),
        (
            "cli",
            CLI_ACTOR.label,
            None,
            "rule.replace",
            "rule",
            r,
            "",
            str(rv),
            str(rv + 1),
            {"ruleset_id": rs},
        ),
        ("cli", CLI_ACTOR.label, None, "rule.delete", "rule", r, "", str(rv + 1), "", {"ruleset_id": rs}),
        ("cli", CLI_ACTOR.label, None, "ruleset.delete", "ruleset", rs, "front2", str(v), "", {}),
    ]

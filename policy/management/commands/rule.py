"""One rule of a ruleset: the same domain functions as /api/v1/rulesets/{id}/rules[/{rule_id}]."""

import json

from controlplane.conditional import if_match_from_header
from controlplane.management.base import PalisadeCommand
from policy import selectors, services
from policy.representations import rule_data


class Command(PalisadeCommand):
    help = "One rule of a ruleset: add, show, replace, delete (If-Match carries the rule's own version)."

    def add_arguments(self, parser):
        super().add_arguments(parser)
        actions = self.add_actions(parser)
        add = actions.add_parser("add", help="add a rule from a JSON file (- for stdin)")
        add.add_argument("ruleset_id")
        add.add_argument("file")
        show = actions.add_parser("show")
        show.add_argument("ruleset_id")
        show.add_argument("rule_id")
        replace = actions.add_parser("replace", help="replace a rule from a JSON file (- for stdin)")
        replace.add_argument("ruleset_id")
        replace.add_argument("rule_id")
        replace.add_argument("file")
        replace.add_argument("--if-match", required=True, help="the rule's version")
        delete = actions.add_parser("delete")
        delete.add_argument("ruleset_id")
        delete.add_argument("rule_id")
        delete.add_argument("--if-match", required=True, help="the rule's version")

    def show_rule(self, ruleset_id, rule_id):
        data = rule_data(selectors.rule_get(ruleset_id=ruleset_id, rule_id=str(rule_id)))
        self.emit(data, json.dumps(data, indent=2))

    def do_add(self, o):
        rule = services.rule_add(
            actor=self.actor, ruleset_id=o["ruleset_id"], data=self.read_json_input(o["file"])
        )
        self.show_rule(o["ruleset_id"], rule.id)

    def do_show(self, o):
        self.show_rule(o["ruleset_id"], o["rule_id"])

    def do_replace(self, o):
        services.rule_replace(
            actor=self.actor,
            ruleset_id=o["ruleset_id"],
            rule_id=o["rule_id"],
            expected_version=if_match_from_header(o["if_match"]),
            data=self.read_json_input(o["file"]),
        )
        self.show_rule(o["ruleset_id"], o["rule_id"])

    def do_delete(self, o):
        services.rule_delete(
            actor=self.actor,
            ruleset_id=o["ruleset_id"],
            rule_id=o["rule_id"],
            expected_version=if_match_from_header(o["if_match"]),
        )
        self.emit({"deleted": o["rule_id"]}, f"deleted rule {o['rule_id']}")

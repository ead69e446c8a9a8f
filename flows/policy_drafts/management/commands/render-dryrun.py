"""Render a hypothetical policy set against the fleet: the same function as POST /policies/render-dryrun."""

from controlplane.management.base import PalisadeCommand
from flows.policy_drafts.dryrun import render_dryrun_request


class Command(PalisadeCommand):
    help = "Which workloads' documents a hypothetical policy (a JSON object with rulesets) would change."

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument("file", help="JSON file, or - for standard input")

    def handle(self, *args, **o):
        data = render_dryrun_request(data=self.read_json_input(o["file"]))
        lines = [f"{data['changed_count']} document(s) would change, {data['unchanged_count']} unchanged"]
        for entry in data["changed"]:
            summary = ", ".join(
                f"{key[6:]} {len(entry[key])}" for key in ("rules_added", "rules_removed", "rules_changed")
            )
            lines.append(f"  {entry['workload_id']}  {summary}")
        lines += [f"warning: {w['path']}: {w['message']}" for w in data["warnings"]]
        self.emit(data, "\n".join(lines))

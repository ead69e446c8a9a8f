"""Policy from evidence (the same domain functions as POST /api/v1/policies/suggestions and
POST /api/v1/policies/impact) and policy as code (export, plan, apply: flows/policy_drafts/as_code/).
One action per method `do_<action>`."""

from __future__ import annotations

import json

from django.core.management.base import CommandError

from controlplane.management.base import PalisadeCommand
from controlplane.problems import ValidationFailed
from controlplane.text import counted, visible
from flows.policy_drafts.management.as_code import (
    add_as_code_actions,
    findings_text,
    run_apply,
    run_export,
    run_plan,
)
from flows.policy_drafts.management.impact import add_impact_action, run_impact
from flows.policy_drafts.management.save import add_save_action, run_save
from flows.policy_drafts.suggestions import policy_suggest_request


class Command(PalisadeCommand):
    help = (
        "Policy from evidence: suggest rules from the stored flows no rule admitted, and the impact of a "
        "draft over them. Policy as code: export the policy as a file, plan and apply a file."
    )

    def add_arguments(self, parser):
        super().add_arguments(parser)
        actions = self.add_actions(parser)
        add_impact_action(actions)
        add_as_code_actions(actions)
        add_save_action(actions)
        suggest = actions.add_parser(
            "suggest",
            help="propose rules from the range's unadmitted flows; --json prints the draft ruleset alone "
            "(for `ruleset create -`), --answer the whole answer",
        )
        suggest.add_argument("--from", dest="start", required=True, help="RFC 3339")
        suggest.add_argument("--to", dest="end", required=True, help="RFC 3339")
        suggest.add_argument(
            "--label", action="append", default=[], help="selector of the workloads to protect"
        )
        suggest.add_argument("--workload", action="append", default=[], help="a workload id to protect")
        suggest.add_argument(
            "--label-key",
            action="append",
            dest="label_keys",
            help="a label key naming a group (default: app and the keys --label requires)",
        )
        suggest.add_argument(
            "--aggregate-prefix", type=int, help="aggregate outside IPv4 peers to this prefix"
        )
        suggest.add_argument(
            "--aggregate-prefix-v6", type=int, help="aggregate outside IPv6 peers to this prefix"
        )
        suggest.add_argument(
            "--include-noise", action="append", default=[],
            help="propose rules for this kind of noise too: scanner, ephemeral-port, lookalike-label",
        )  # fmt: skip
        suggest.add_argument(
            "--exclude-peer", action="append", default=[], help="an address or CIDR never learnt from"
        )
        suggest.add_argument(
            "--direction", choices=("inbound", "outbound"),
            help="inbound (the default): rules for the connections the workloads receive; outbound: for those "
            "they open",
        )  # fmt: skip
        suggest.add_argument("--answer", action="store_true", help="print the whole answer as JSON")

    def do_suggest(self, o):
        body = {"from": o["start"], "to": o["end"], "label": o["label"], "workload": o["workload"]}
        if o["label_keys"]:
            body["label_keys"] = o["label_keys"]
        for name in ("aggregate_prefix", "aggregate_prefix_v6"):
            if o[name] is not None:
                body[name] = o[name]
        if o["include_noise"]:
            body["include_noise"] = o["include_noise"]
        if o["exclude_peer"]:
            body["exclude_peers"] = o["exclude_peer"]
        if o["direction"]:
            body["direction"] = o["direction"]
        answer = policy_suggest_request(data=body)
        if o["answer"]:
            self.stdout.write(json.dumps(answer, indent=2))
            return
        if not answer["complete"]:
            # Prominent whatever is printed: on standard error, where a pipe does not swallow it.
            self.stderr.write(f"warning: {answer['warning']}")
            for interval in answer["incomplete_intervals"]:
                self.stderr.write(
                    f"  {interval['start']} .. {interval['end']}  "
                    f"{interval['workload_id'] or 'every workload'}: {interval['reason']}"
                )
        if self.as_json:
            if answer["draft"] is None:
                raise CommandError(_no_single_draft(answer))
            self.stdout.write(json.dumps(answer["draft"], indent=2))
            for group in answer["address_groups"]:
                self.stderr.write(
                    f"note: the draft names the address group {group['name']!r}: save the whole "
                    "draft with `policy suggest --answer ... | policy save -`"
                )
            return
        self.stdout.write(_text(answer))

    def do_save(self, o):
        run_save(self, o)

    def do_impact(self, o):
        run_impact(self, o)

    def do_export(self, o):
        run_export(self, o)

    def do_plan(self, o):
        self._file_paths = True
        run_plan(self, o)

    def do_apply(self, o):
        self._file_paths = True
        run_apply(self, o)

    _file_paths = False

    def report_problem(self, problem):
        # A policy file's findings name places in the file (`rulesets[2].rules[0]...`), not pointers.
        if self._file_paths and not self.as_json and isinstance(problem, ValidationFailed):
            for line in findings_text(problem):
                self.stderr.write(line)
            return
        super().report_problem(problem)


def _no_single_draft(answer: dict) -> str:
    if not answer["rulesets"]:
        left = len(answer["not_generalised"])
        return f"nothing to propose: no unadmitted connection in the range could be generalised ({left} could not)"
    scopes = ", ".join(r["scope"] for r in answer["rulesets"])
    return f"the evidence has {len(answer['rulesets'])} scopes ({scopes}): select one with --label"


def _service_text(service: dict) -> str:
    if "service" in service:
        return visible(service["service"])
    return f"{service['protocol']}/{service['port']}" if "port" in service else service["protocol"]


def _text(answer: dict) -> str:
    lines = [f"label keys: {', '.join(answer['label_keys'])}; range {answer['from']} .. {answer['to']}"]
    if not answer["complete"]:
        lines.append("INCOMPLETE RANGE: see the warning above; the proposal may lack traffic.")
    for group in answer["address_groups"]:
        lines.append(f"address group to create: {visible(group['name'])}: {', '.join(group['members'])}")
    for unseen in answer["address_group_evidence"]:
        if unseen["unseen_addresses_admitted"]:
            lines.append(
                f"  {visible(unseen['name'])} admits "
                f"{counted(unseen['unseen_addresses_admitted'], 'address', 'addresses')} never seen"
            )
    for note in answer["scope_notes"]:
        narrowed = note["narrowed_to"]
        lines.append(
            f"scope {visible(note['scope'])} narrowed to {visible(narrowed)}: {visible(note['reason'])}"
            if narrowed
            else f"scope {visible(note['scope'])} not proposed: {visible(note['reason'])}"
        )
    for ruleset, evidence in zip(answer["rulesets"], answer["evidence"], strict=True):
        outbound = ruleset.get("direction") == "outbound"
        lines.append(
            f"ruleset {visible(ruleset['name'])}  scope {visible(ruleset['scope'])}"
            + ("  outbound" if outbound else "")
        )
        for rule, seen in zip(ruleset["rules"], evidence["rules"], strict=True):
            peers = ", ".join(
                visible(next(iter(s.values()))) for s in rule.get("sources") or rule["destinations"]
            )
            services = ", ".join(_service_text(s) for s in rule["services"])
            lines.append(
                (f"  to {peers} on {services}: " if outbound else f"  from {peers} to {services}: ")
                + f"{counted(seen['connection_count'], 'connection')} "
                + (f"to {counted(len(seen['peers']), 'destination')}" if outbound
                   else f"from {counted(len(seen['peers']), 'peer')}")
                + f", {seen['first_seen']} .. {seen['last_seen']}"
            )  # fmt: skip
            breadth = seen["breadth"]
            lines.append(
                f"    admits {breadth['admitted']} (workload, peer, service) combinations, {breadth['seen']} seen"
                + (" -- WIDER THAN SEEN" if breadth["wider_than_seen"] else "")
            )
            for ranged in seen["port_ranges"]:
                lines.append(
                    f"    {ranged['protocol']}/{ranged['port']}-{ranged['port_to']} is a range: "
                    f"{ranged['ports_seen']} of its ports seen, {ranged['ports_unseen']} not"
                )
    for kind in answer["set_apart_summary"]:
        lines.append(
            f"set apart as {kind['kind']}: {counted(kind['count'], 'flow key')} "
            f"({counted(kind['connection_count'], 'connection')}); e.g. {visible(kind['reasons'][0])}"
        )
    for row in answer["not_generalised"]:
        lines.append(
            f"not generalised: {row['peer']} -> {row['service']['protocol']}/{row['service']['port']} "
            f"({counted(row['connection_count'], 'connection')}): {visible(row['reason'])}"
        )
    if answer["truncated"]:
        lines.append(
            f"TRUNCATED: {counted(answer['keys_left_out'], 'flow key')} of fewest connections not learnt from "
            f"({counted(answer['connections_left_out'], 'connection')}): narrow the selection or the range"
        )
    if not answer["rulesets"]:
        lines.append("no rule proposed")
    return "\n".join(lines)

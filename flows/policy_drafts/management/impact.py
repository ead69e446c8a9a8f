"""`manage.py policy impact`: the same function as POST /api/v1/policies/impact. Kept apart from the
command so that the `policy` command's other actions (suggest) and this one join with two lines."""

from __future__ import annotations

from controlplane.text import counted, visible
from flows.policy_drafts.impact import policy_impact


def add_impact_action(actions) -> None:
    impact = actions.add_parser(
        "impact",
        help="which stored flow keys of a range a draft policy (a render dry-run's JSON) would newly refuse "
        "or admit",
    )
    impact.add_argument(
        "file", help="JSON file of the draft (as render-dryrun reads it), or - for standard input"
    )
    impact.add_argument("--from", dest="start", required=True, help="RFC 3339")
    impact.add_argument("--to", dest="end", required=True, help="RFC 3339")
    impact.add_argument("--label", action="append", default=[], help="selector of the workloads; repeatable")
    impact.add_argument("--workload", action="append", default=[], help="a workload id; repeatable")
    impact.add_argument(
        "--direction", choices=("inbound", "outbound", "any"),
        help="the evidence judged (default: the draft's rulesets' direction, inbound for none)",
    )  # fmt: skip


def run_impact(command, o) -> None:
    draft = command.read_json_input(o["file"])
    selection = {"from": o["start"], "to": o["end"], "label": o["label"], "workload": o["workload"]}
    if o["direction"]:
        selection["direction"] = o["direction"]
    # A draft that is not an object is refused by the function, as the endpoint refuses it.
    body = {**draft, **selection} if isinstance(draft, dict) else draft
    answer = policy_impact(data=body)
    command.emit(answer, impact_text(answer))


def _service(entry: dict) -> str:
    return (
        f"{entry['protocol']}/{entry['port']}" if entry["protocol"] in ("tcp", "udp") else entry["protocol"]
    )


def _rule(rule: dict | None) -> str:
    return (
        "no rule"
        if rule is None
        else f"rule {rule['number']} ({visible(rule['ruleset_name'])} #{rule['position']})"
    )


def impact_text(answer: dict) -> str:
    refused, admitted = answer["newly_refused_summary"], answer["newly_admitted_summary"]
    lines = []
    if not answer["coverage"]["complete"]:
        lines.append("INCOMPLETE RANGE: the evidence has gaps or silent, pending or unreported workloads:")
        lines.append(
            f"  {counted(answer['coverage']['gap_count'], 'gap')}, "
            f"{counted(answer['coverage']['workloads_without_reports_count'], 'workload')} without reports, "
            f"{answer['coverage']['silent_workloads_count']} silent, "
            f"{answer['coverage']['pending_workloads_count']} pending"
        )
    lines.append(
        f"{answer['from']} .. {answer['to']}: {counted(answer['keys_classified'], 'flow key')}; the draft would "
        f"newly refuse {counted(refused['connection_count'], 'connection')} from "
        f"{counted(refused['peer_count'], 'peer')} to {counted(refused['service_count'], 'service')}, and newly "
        f"admit {counted(admitted['connection_count'], 'connection')}"
    )
    for title, entries in (
        ("newly refused", answer["newly_refused"]),
        ("newly admitted", answer["newly_admitted"]),
    ):
        for e in entries:
            lines.append(
                f"  {title}: {e['workload_id']} {'->' if e.get('direction') == 'outbound' else '<-'} "
                f"{e['peer']} {_service(e)}: "
                f"{counted(e['connection_count'], 'connection')}, "
                f"{e['first_seen']} .. {e['last_seen']}; now {_rule(e['rule_now'])}, draft {_rule(e['rule_draft'])}"
            )
    if answer["keys_left_out"]:
        lines.append(
            f"  TRUNCATED: {counted(answer['keys_left_out'], 'flow key')} of fewest connections not judged "
            f"({counted(answer['connections_left_out'], 'connection')}): narrow the selection or the range"
        )
    if answer["truncated"]:
        lines.append("  (lists truncated: --json gives the counts)")
    lines += [f"warning: {w['path']}: {w['message']}" for w in answer["warnings"]]
    return "\n".join(lines)

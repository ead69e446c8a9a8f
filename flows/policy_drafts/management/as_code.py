"""`manage.py policy export|plan|apply`: policy as code (flows/policy_drafts/as_code/). Kept apart from the
command, as the impact action is, so that the `policy` command joins them with a few lines."""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile

from django.core.management.base import CommandError

from controlplane.text import counted, visible
from flows.policy_drafts.as_code.apply import policy_apply
from flows.policy_drafts.as_code.format import FORMATS, dump, file_path, policy_export_data, policy_file_load
from flows.policy_drafts.as_code.plan import policy_plan


def add_as_code_actions(actions) -> None:
    export = actions.add_parser(
        "export", help="write services, address groups and rulesets as a reviewable file (sorted, by name)"
    )
    export.add_argument("--format", choices=FORMATS, default="yaml")
    export.add_argument("-o", "--output", help="write to FILE (atomically) instead of standard output")
    plan = actions.add_parser(
        "plan", help="what applying FILE would do, field by field, and the version to pass to apply"
    )
    apply = actions.add_parser(
        "apply", help="do exactly the plan of FILE in one transaction, if the policy has not moved since"
    )
    for sub in (plan, apply):
        sub.add_argument(
            "file", help="a policy file (YAML, or JSON when it ends in .json), - for standard input"
        )
        sub.add_argument(
            "--prune", action="store_true", help="delete stored objects the file does not name (else kept)"
        )
    plan.add_argument(
        "--from", dest="start", help="RFC 3339: start of the impact's range (default: 7 days ago)"
    )
    plan.add_argument("--to", dest="end", help="RFC 3339: end of the impact's range (default: now)")
    apply.add_argument(
        "--expect-policy-version",
        required=True,
        help="the policy version the plan printed: apply refuses if the policy moved since",
    )


def _read(path: str):
    source = "standard input" if path == "-" else path
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, "rb") as file:
                text = file.read()
    except OSError as error:
        raise CommandError(f"cannot read {path}: {error.strerror}") from None
    return policy_file_load(text=text, source=source), source


def run_export(command, o) -> None:
    text = dump(policy_export_data(), format=o["format"])
    if not o["output"]:
        command.stdout.write(text, ending="")
        return
    directory = os.path.dirname(os.path.abspath(o["output"]))
    try:
        fd, aside = tempfile.mkstemp(dir=directory, prefix=".policy-export-")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(aside, o["output"])
    except OSError as error:
        raise CommandError(f"cannot write {o['output']}: {error.strerror}") from None


def run_plan(command, o) -> None:
    data, source = _read(o["file"])
    answer = policy_plan(data=data, prune=o["prune"], impact_from=o["start"], impact_to=o["end"])
    command.emit(answer, plan_text(answer, o["file"], prune=o["prune"]))


def run_apply(command, o) -> None:
    data, source = _read(o["file"])
    answer = policy_apply(
        actor=command.actor,
        data=data,
        prune=o["prune"],
        expected_version=o["expect_policy_version"],
        source=source,
    )
    if answer["applied"]:
        lines = change_lines(answer)
        lines.append(
            f"applied {answer['applied']} changes from {visible(source)}: policy version "
            f"{answer['policy_version_before']} -> {answer['policy_version']}"
        )
    else:
        lines = [f"no changes: policy version {answer['policy_version']}"]
    command.emit(answer, "\n".join(lines))


def findings_text(problem) -> list[str]:
    return [f"error: {file_path(f.path)}: {f.message} [{f.rule}]" for f in problem.findings]


# --- the plan as text ---------------------------------------------------------------------------


def _entry(item: dict) -> str:
    if "service" in item:
        return f"service {visible(item['service'])}"
    if "selector" in item:
        return f"selector {visible(json.dumps(item['selector']))}"
    if "address_group" in item:
        return f"group {visible(item['address_group'])}"
    if "any" in item:
        return "any"
    port = item.get("port")
    if port is None:
        return item["protocol"]
    return f"{item['protocol']}/{port}" + (f"-{item['port_to']}" if item.get("port_to") else "")


def _rule(rule: dict) -> str:
    text = (
        (f"rule {rule['number']} " if "number" in rule else "")
        + f"from {', '.join(_entry(s) for s in rule['sources'])} "
        f"to {', '.join(_entry(s) for s in rule['services'])}"
    )
    if rule.get("description"):
        text += f"  ({visible(json.dumps(rule['description']))})"
    return text


def _value(key: str, value) -> str:
    if key.endswith(("entries", "sources", "services")) and isinstance(value, list):
        return "[" + ", ".join(_entry(v) for v in value) + "]"
    if key == "rules" and isinstance(value, list):
        return f"{len(value)} rules" + "".join(f"\n        {i}: {_rule(r)}" for i, r in enumerate(value))
    if key == "members" and isinstance(value, list):
        return f"{len(value)} members: " + ", ".join(value[:20]) + (", ..." if len(value) > 20 else "")
    return visible(json.dumps(value))


def _field(change: dict) -> str:
    name, action = change["field"], change["action"]
    if action == "set":
        return f"{name}: {_value(name, change['new'])}"
    if action == "add":
        return f"{name}: added: {_rule(change['new'])}"
    if action == "remove":
        return f"{name} (stored): removed: {_rule(change['old'])}"
    if action == "reorder":
        return f"rules reordered: the kept rules, by old position, now run {change['new']}"
    if name == "members":
        old, new = set(change["old"]), set(change["new"])
        added, removed = (
            [m for m in change["new"] if m not in old],
            [m for m in change["old"] if m not in new],
        )
        parts = [f"+{m}" for m in added[:20]] + [f"-{m}" for m in removed[:20]]
        more = len(added) + len(removed) - len(parts)
        return f"members: {' '.join(parts)}" + (f" (and {more} more)" if more else "")
    return f"{name}: {_value(name, change['old'])} -> {_value(name, change['new'])}"


_SIGNS = {"create": "+", "change": "~", "delete": "-"}


def change_lines(answer: dict) -> list[str]:
    lines = []
    for change in answer["changes"]:
        kind = change["type"].replace("_", " ")
        lines.append(
            f"{_SIGNS[change['action']]} {change['action']} {kind} {visible(json.dumps(change['name']))}"
        )
        lines += [f"    {_field(f)}" for f in change["fields"]]
    return lines


def plan_text(answer: dict, path: str, *, prune: bool) -> str:
    lines = change_lines(answer)
    for kept in answer["kept"]:
        lines.append(
            f"  kept, not in file: {kept['type'].replace('_', ' ')} {visible(json.dumps(kept['name']))}"
        )
    if answer["kept"]:
        lines.append("  (--prune deletes what the file does not name)")
    if not answer["changes"]:
        lines.insert(0, f"no changes (policy version {answer['policy_version']})")
        return "\n".join(lines)
    render = answer["render"]
    changed = counted(render["changed_count"], "workload's document changes", "workloads' documents change")
    lines.append(f"render dry-run: {changed}, {render['unchanged_count']} unchanged")
    impact = answer["impact"]
    refused, admitted = impact["newly_refused_summary"], impact["newly_admitted_summary"]
    lines.append(
        f"impact over {impact['from']} .. {impact['to']} ({counted(impact['keys_classified'], 'flow key')}): "
        f"newly refused {counted(refused['connection_count'], 'connection')} ({counted(refused['count'], 'key')}, "
        f"{counted(refused['peer_count'], 'peer')}, {counted(refused['workload_count'], 'workload')}); newly "
        f"admitted {counted(admitted['connection_count'], 'connection')} ({counted(admitted['count'], 'key')})"
    )
    coverage = impact["coverage"]
    if not coverage["complete"]:
        lines.append(
            f"  INCOMPLETE EVIDENCE: {counted(coverage['gap_count'], 'gap')}, "
            f"{counted(coverage['workloads_without_reports_count'], 'workload')} without reports, "
            f"{coverage['silent_workloads_count']} silent, {coverage['pending_workloads_count']} pending: "
            "traffic not seen is not judged"
        )
    if impact["keys_left_out"]:
        lines.append(
            f"  TRUNCATED: {counted(impact['keys_left_out'], 'flow key')} of fewest connections not judged "
            f"({counted(impact['connections_left_out'], 'connection')}): narrow the range with --from/--to"
        )
    lines += [f"warning: {file_path(w['path'])}: {w['message']}" for w in answer["warnings"]]
    command = ["manage.py", "policy", "apply", path]
    if prune:
        command.append("--prune")
    command += ["--expect-policy-version", answer["policy_version"]]
    lines.append(
        f"{len(answer['changes'])} changes planned against policy version {answer['policy_version']}; apply exactly this with:"
    )
    lines.append("  " + visible(shlex.join(command)))
    return "\n".join(lines)

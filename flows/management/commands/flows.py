"""Flow evidence from the host: the same selectors as GET /api/v1/flows and /flows/gaps, as a table,
JSON (`--json`) or CSV (`--csv`, for spreadsheets)."""

import json
import sys

from django.core.management.base import CommandError

from controlplane.management.base import PalisadeCommand
from controlplane.pagination import MAX_LIMIT
from controlplane.text import counted, visible
from controlplane.validation import parsed_together
from flows import selectors, validation
from flows.choices import READ_DIRECTIONS, Decision, Direction
from flows.csv_rows import GAP_COLUMNS, csv_text, rollup_columns, rollup_row
from flows.policy_drafts.review_now import simulation_review_now
from flows.representations import (
    coverage_data,
    evidence_gap_data,
    flow_window_data,
    review_data,
    rollup_data,
)

GROUP_COLUMNS = ("window_start", "window_end", "peer", "peer_workload_id", "protocol", "port", "decision",
                 "rule_number", "rule_id", "connection_count", "first_seen", "last_seen", "bytes_in", "bytes_out")  # fmt: skip
# ... and of a list read with --direction outbound or any.
DIRECTION_COLUMNS = ("direction", "failsafe")
EXIT_REVIEW_FAILED = 3  # apart from a refused command's 1 and 2


def _pages(fetch):
    items, cursor = [], None
    while True:
        page = fetch(cursor)
        items.extend(page.items)
        if not (cursor := page.next_cursor):
            return items


def _selection(o) -> validation.FlowSelection:
    return validation.flow_selection_parse(
        start=o["start"], end=o["end"], labels=o["label"], workloads=o["workload"], direction=o["direction"]
    )


def _selected(selection: validation.FlowSelection):
    return selectors.workloads_selected(workload_ids=selection.workload_ids, labels=selection.labels)


def _csv(columns, rows) -> str:
    return csv_text(columns, rows).rstrip("\n")


class Command(PalisadeCommand):
    help = "Stored flow evidence: list (one workload's windows) and gaps (of a set of workloads)."

    def add_arguments(self, parser):
        super().add_arguments(parser)
        actions = self.add_actions(parser)
        listing = actions.add_parser("list", help="one workload's windows in a range, one row per group")
        listing.add_argument("--workload", required=True)
        listing.add_argument("--decision", choices=Decision.values)
        listing.add_argument("--peer")
        listing.add_argument("--service", help="tcp/443, udp/53, icmp, icmpv6")
        listing.add_argument("--rule", help="a rule's lifetime number")
        gaps = actions.add_parser("gaps", help="evidence gaps intersecting a range")
        rollup = actions.add_parser("rollup", help="sums grouped by keys, with the range's coverage")
        rollup.add_argument("--group-by", action="append", required=True, choices=list(validation.GROUP_KEYS))
        review = actions.add_parser(
            "review", help="the simulation review: pass or fail, and why; exits 3 when it fails"
        )
        for sub in (gaps, rollup, review):
            sub.add_argument("--workload", action="append", default=[], help="repeatable")
            sub.add_argument(
                "--label", action="append", default=[], help="label requirement; repeatable, ANDed"
            )
        for sub in (listing, gaps, rollup, review):
            sub.add_argument("--from", dest="start", required=True, help="RFC 3339 instant")
            sub.add_argument("--to", dest="end", required=True, help="RFC 3339 instant, at most 31 days on")
            sub.add_argument(
                "--direction",
                choices=READ_DIRECTIONS,
                default=Direction.INBOUND,
                help="whose connections: inbound (the default), outbound (the workload's own) or any",
            )
        for sub in (listing, gaps, rollup):
            sub.add_argument("--csv", action="store_true", help="print CSV")

    def handle(self, *args, **options):
        if options.get("csv") and self.as_json:
            raise CommandError("--csv and --json each choose the output: give one")
        super().handle(*args, **options)

    def do_list(self, o):
        start, end = validation.flow_range_parse(start=o["start"], end=o["end"])
        groups = validation.group_filters_parse(
            decision=o["decision"], peer=o["peer"], service=o["service"], rule=o["rule"]
        )
        direction = validation.direction_parse(o["direction"])
        windows = _pages(
            lambda cursor: selectors.flow_windows_list(
                workload_id=o["workload"],
                start=start,
                end=end,
                cursor=cursor,
                limit=MAX_LIMIT,
                groups=groups,
                direction=direction,
            )
        )
        numbers = {group.rule_number for window in windows for group in window.groups.all()}
        rule_ids = selectors.rule_ids_by_number(numbers)
        directions = direction != Direction.INBOUND
        data = [flow_window_data(window, rule_ids, directions=directions) for window in windows]
        rows = [
            {"window_start": w["start"], "window_end": w["end"], **group}
            for w in data
            for group in w["groups"]
        ]
        if o["csv"]:
            self.stdout.write(_csv(GROUP_COLUMNS + (DIRECTION_COLUMNS if directions else ()), rows))
            return
        lines = [
            f"{'WINDOW':20}  {'PEER':39}  {'SERVICE':10}  {'DECISION':11}  {'RULE':>6}  {'CONNS':>7}  BYTES IN/OUT"
        ]
        for row in rows:
            service = f"{row['protocol']}/{row['port']}" if row["port"] else row["protocol"]
            lines.append(
                f"{row['window_start'][:19]:20}  {row['peer']:39}  {service:10}  {row['decision']:11}  "
                f"{row['rule_number'] or '-':>6}  {row['connection_count']:>7}  {row['bytes_in']}/{row['bytes_out']}"
            )
        self.emit({"items": data, "next_cursor": None}, "\n".join(lines))

    def do_gaps(self, o):
        selection = _selection(o)
        gaps = _pages(
            lambda cursor: selectors.evidence_gaps_list(
                workload_ids=selection.workload_ids,
                labels=selection.labels,
                start=selection.start,
                end=selection.end,
                cursor=cursor,
                limit=MAX_LIMIT,
            )
        )
        data = [evidence_gap_data(gap) for gap in gaps]
        if o["csv"]:
            self.stdout.write(_csv(GAP_COLUMNS, data))
            return
        lines = [f"{'WORKLOAD':36}  {'KIND':16}  {'SOURCE':9}  {'START':20}  {'END':20}  LOST"]
        for gap in data:
            lost = ",".join(f"{visible(k)}={v}" for k, v in gap["lost"].items()) or "-"  # the agent's names
            lines.append(
                f"{gap['workload_id']:36}  {gap['kind']:16}  {gap['source'] or '-':9}  {gap['start'][:19]:20}  "
                f"{gap['end'][:19]:20}  {lost}"
            )
        self.emit({"items": data, "next_cursor": None}, "\n".join(lines))

    def do_rollup(self, o):
        selection, group_by = parsed_together(
            lambda: _selection(o), lambda: validation.group_by_parse(o["group_by"])
        )
        # Every row at once: as GET /flows/rollup answers with every page in it (no cursor left).
        rollup = selectors.flow_rollup_read(
            selected=_selected(selection),
            group_by=group_by,
            start=selection.start,
            end=selection.end,
            cursor=None,
            limit=None,
            direction=selection.direction,
        )
        covered, unused = coverage_data(rollup.coverage), rollup.unused_rules
        document = rollup_data(
            rollup.rows, rule_ids=rollup.rule_ids, next_cursor=None, coverage=covered, unused_rules=unused
        )
        # One document holds at most ROLLUP_ROWS rows: past them it says how many it left out.
        document["truncated"], document["rows_left_out"] = rollup.rows_left_out > 0, rollup.rows_left_out
        left_out = (
            f"truncated: {counted(rollup.rows_left_out, 'more row')} not shown (at most "
            f"{selectors.ROLLUP_ROWS:,} at once): narrow the selection or the range, or page GET /flows/rollup"
        )
        flat = [rollup_row(row) for row in document["items"]]
        incomplete = (
            f"incomplete: {counted(covered['gap_count'], 'gap')}, "
            f"{counted(covered['workloads_without_reports_count'], 'workload')} sent no window in the range, "
            f"{covered['silent_workloads_count']} silent since before its end, "
            f"{covered['pending_workloads_count']} holding evidence not delivered yet"
            + (
                f", evidence before {covered['retained_from']} removed"
                if covered["begins_before_retention"]
                else ""
            )
        )
        if o["csv"]:
            self.stdout.write(_csv(rollup_columns(group_by), flat))
            if not covered["complete"]:  # beside the data, where a spreadsheet would not take it for a row
                self.stderr.write(incomplete + " (--json lists them)")
            if rollup.rows_left_out:
                self.stderr.write(left_out)
            return
        lines = [json.dumps(row, sort_keys=True) for row in flat] or ["no flows in the range"]
        if not covered["complete"]:
            lines.append(incomplete)
        if rollup.rows_left_out:
            lines.append(left_out)
        if unused:
            lines.append(
                "unused in the range: "
                + ", ".join(
                    f"{'deny ' if rule.action == 'deny' else ''}rule {rule.number} ({rule.ruleset.name})"
                    for rule in unused
                )
            )
        self.emit(document, "\n".join(lines))

    def do_review(self, o):
        selection = _selection(o)
        review = simulation_review_now(
            selected=_selected(selection),
            start=selection.start,
            end=selection.end,
            direction=selection.direction,
        )
        data = {**review_data(review), "judged_against": review["judged_against"], "now": review["now"]}
        now = data["now"]
        text = (
            data["verdict"].upper()
            + f" (judged on {data['judged_against']})"
            + "".join(f"\n  - {reason}" for reason in data["reasons"])
            + f"\n{now['verdict'].upper()} against {now['judged_against']}"
            + "".join(f"\n  - {reason}" for reason in now["reasons"])
        )
        self.emit(data, text)
        if data["verdict"] == "fail":  # a pipeline gates on the exit status alone
            sys.exit(EXIT_REVIEW_FAILED)

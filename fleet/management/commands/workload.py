"""Workloads from the host: the same reads and writes as /api/v1/workloads."""

import json

from controlplane.conditional import if_match_from_header
from controlplane.management.base import PalisadeCommand
from controlplane.pagination import MAX_LIMIT
from controlplane.text import visible
from fleet import credentials, selectors, services
from fleet.choices import Mode, SyncState
from fleet.representations import labels_data, rendered_policy_data, workload_data


class Command(PalisadeCommand):
    help = (
        "Workloads: list, show, counts, rendered-policy, labels, set-labels, resend-snapshot, "
        "revoke-credential."
    )

    def add_arguments(self, parser):
        super().add_arguments(parser)
        actions = self.add_actions(parser)
        listing = actions.add_parser("list", help="the fleet in fleet order")
        listing.add_argument(
            "--label", action="append", default=[], help="label requirement; repeatable, ANDed"
        )
        listing.add_argument("--id", action="append", default=[], help="workload id; repeatable")
        listing.add_argument("--sync-state", choices=SyncState.values)
        listing.add_argument(
            "--outbound-mode", choices=Mode.values, help="only workloads with this outbound mode"
        )
        listing.add_argument("--removed", choices=["true", "false"])
        actions.add_parser("counts", help="totals per sync state and removed")
        for name in ("show", "rendered-policy", "labels", "resend-snapshot"):
            actions.add_parser(name).add_argument("workload_id")
        set_labels = actions.add_parser(
            "set-labels", help='replace labels from a JSON file or - ({"labels": {...}})'
        )
        set_labels.add_argument("workload_id")
        set_labels.add_argument("file")
        set_labels.add_argument("--if-match", required=True, help="the label set's version")
        revoke = actions.add_parser(
            "revoke-credential",
            help="cut a compromised workload off: its stream closes, its reports, renewals and key "
            "rotations are refused until re-enrolled with a token minted for it",
        )
        revoke.add_argument("workload_id")
        revoke.add_argument("--reason", help="why, shown on the workload (one line)")

    def do_list(self, o):
        filters = selectors.workload_filters_parse(
            labels=o["label"],
            sync_state=o["sync_state"],
            removed=o["removed"],
            ids=o["id"],
            outbound_mode=o["outbound_mode"],
        )
        items, cursor = [], None
        while True:
            page = selectors.workload_list(**filters, cursor=cursor, limit=MAX_LIMIT)
            items.extend(workload_data(w) for w in page.items)
            if not (cursor := page.next_cursor):
                break
        lines = [f"{'ID':36}  {'HOSTNAME':24}  {'MODE':10}  {'SYNC':8}  {'TABLE':7}  LABELS"]
        for w in items:
            labels = visible(",".join(f"{k}={v}" for k, v in sorted(w["labels"].items())))
            lines.append(
                f"{w['id']:36}  {visible(w['hostname'])[:24]:24}  {w['mode']:10}  {w['sync']['state']:8}  "
                f"{w['health']['owned_table']['state']:7}  {labels}"
            )
        self.emit(items, "\n".join(lines))

    def do_counts(self, o):
        counts = selectors.workload_counts()
        states = "  ".join(f"{k} {v}" for k, v in counts["sync_state"].items())
        self.emit(counts, f"total {counts['total']}  {states}  removed {counts['removed']}")

    def _show(self, data):
        self.emit(data, json.dumps(data, indent=2))

    def do_show(self, o):
        self._show(workload_data(selectors.workload_get(workload_id=o["workload_id"])))

    def do_rendered_policy(self, o):
        workload = selectors.workload_get(workload_id=o["workload_id"])
        data = rendered_policy_data(workload, workload.latest_policy)
        self.emit(data, data["document"] or "(no document rendered yet)")

    def do_labels(self, o):
        self._show(labels_data(selectors.workload_get(workload_id=o["workload_id"])))

    def do_set_labels(self, o):
        workload = services.workload_labels_replace(
            actor=self.actor,
            workload_id=o["workload_id"],
            expected_version=if_match_from_header(o["if_match"]),
            data=self.read_json_input(o["file"]),
        )
        self._show(labels_data(workload))

    def do_resend_snapshot(self, o):
        workload = services.workload_resend_snapshot(actor=self.actor, workload_id=o["workload_id"])
        self.emit(
            {"workload_id": str(workload.id), "directive": "sent"},
            f"resend directive sent to {workload.hostname}",
        )

    def do_revoke_credential(self, o):
        data = {} if o["reason"] is None else {"reason": o["reason"]}
        workload = credentials.credential_revoke(actor=self.actor, workload_id=o["workload_id"], data=data)
        self.emit(
            workload_data(workload),
            f"revoked the credential of {workload.hostname} ({workload.id}); it comes back only by a "
            "re-enrolment with a provisioning token minted for it (provisioning-token mint --workload-id)",
        )

"""Mode changes from the host: the same domain functions as POST /mode-changes, GET /mode-changes(/{id})
and POST /mode-changes/{id}/confirm."""

from controlplane.management.base import PalisadeCommand
from controlplane.pagination import MAX_LIMIT
from fleet import selectors
from fleet.choices import Mode
from fleet.mode_confirmations import CONFIRM_WITHIN_MAX, CONFIRM_WITHIN_MIN, mode_change_confirm
from fleet.representations import mode_change_data, mode_change_detail_data
from fleet.services import mode_change_create


def _summary(data: dict) -> str:
    line = (
        f"{'outbound ' if data['direction'] == 'outbound' else ''}"
        f"{data['mode'] or 'each to its mode before'}: {data['resolved_count']} selected, "
        f"{data['changed_count']} changed (mode change {data['id']})"
    )
    if data["confirmation"] == "awaiting":
        line += (
            f"; reverts unless confirmed by {data['confirm_by']}: manage.py mode-change confirm {data['id']}"
        )
    elif data["confirmation"] == "confirmed":
        line += f"; confirmed at {data['confirmed_at']} by {data['confirmed_by']}"
    elif data["confirmation"] == "reverted":
        line += f"; not confirmed by {data['confirm_by']}: put back by mode change {data['reverted_by']}"
    if data["reverts"]:
        line += f"; {data['reason']}"
    return line


class Command(PalisadeCommand):
    help = (
        "Mode changes: move the selected workloads to a mode (MODE: visibility, simulation, enforced; "
        "returns once the intent is recorded and documents rendered), optionally to be confirmed within "
        "N seconds or put back; confirm one; show one; list them."
    )

    def add_arguments(self, parser):
        super().add_arguments(parser)
        actions = self.add_actions(parser)
        for mode in Mode.values:
            change = actions.add_parser(mode, help=f"move the selected workloads to {mode}")
            change.add_argument(
                "--label", action="append", default=[], help="label requirement; repeatable, ANDed"
            )
            change.add_argument("--workload", action="append", default=[], help="workload id; repeatable")
            change.add_argument("--all", action="store_true", help="every workload of the fleet")
            change.add_argument(
                "--direction",
                choices=("inbound", "outbound"),
                default="inbound",
                help="which mode to move: inbound (the default) or outbound (the connections they open)",
            )
            change.add_argument(
                "--confirm-within",
                type=int,
                metavar="SECONDS",
                help=f"unless confirmed within SECONDS ({CONFIRM_WITHIN_MIN} to {CONFIRM_WITHIN_MAX}), the "
                "system puts each workload back into the mode it had before",
            )
        actions.add_parser("confirm", help="confirm a mode change before its deadline").add_argument(
            "mode_change_id"
        )
        actions.add_parser(
            "show", help="one mode change, with the mode each workload would go (or went) back to"
        ).add_argument("mode_change_id")
        listing = actions.add_parser("list", help="mode changes, newest first")
        listing.add_argument("--confirmation", help="awaiting, confirmed or reverted")
        listing.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")

    def _change(self, mode, o):
        selection: dict = {}
        if o["label"]:
            selection["labels"] = o["label"]
        if o["workload"]:
            selection["workload_ids"] = o["workload"]
        if o["all"]:
            selection["all"] = True
        body: dict = {"selection": selection, "mode": mode}
        if o["direction"] != "inbound":
            body["direction"] = o["direction"]
        if o["confirm_within"] is not None:
            body["confirm_within_seconds"] = o["confirm_within"]
        data = mode_change_data(mode_change_create(actor=self.actor, data=body))
        self.emit(data, _summary(data))

    def do_visibility(self, o):
        self._change(Mode.VISIBILITY, o)

    def do_simulation(self, o):
        self._change(Mode.SIMULATION, o)

    def do_enforced(self, o):
        self._change(Mode.ENFORCED, o)

    def do_confirm(self, o):
        data = mode_change_data(mode_change_confirm(actor=self.actor, mode_change_id=o["mode_change_id"]))
        self.emit(data, _summary(data))

    def do_show(self, o):
        data = mode_change_detail_data(selectors.mode_change_get(mode_change_id=o["mode_change_id"]))
        lines = [_summary(data)]
        lines += [f"  {w['workload_id']}  {w['mode_before']} -> {w['mode_after']}" for w in data["workloads"]]
        lines += [
            f"  {w['workload_id']}  left alone in {w['mode']} (taken over by mode change {w['moved_by']})"
            for w in data["left_alone"]
        ]
        self.emit(data, "\n".join(lines))

    def do_list(self, o):
        wanted = max(o["limit"], 1)
        items, cursor = [], None
        while len(items) < wanted:
            page = selectors.mode_change_list(
                confirmation=o["confirmation"], cursor=cursor, limit=min(MAX_LIMIT, wanted - len(items))
            )
            items.extend(mode_change_data(change) for change in page.items)
            if not (cursor := page.next_cursor):
                break
        self.emit(items, "\n".join(f"{item['created_at']}  {_summary(item)}" for item in items) or "(none)")

"""Change the mode of a selection of workloads: the same domain function as POST /mode-changes."""

from controlplane.management.base import PalisadeCommand
from fleet.choices import Mode
from fleet.representations import mode_change_data
from fleet.services import mode_change_create


class Command(PalisadeCommand):
    help = (
        "Move the selected workloads to a mode; returns once the intent is recorded and documents rendered."
    )

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument("mode", choices=Mode.values)
        parser.add_argument(
            "--label", action="append", default=[], help="label requirement; repeatable, ANDed"
        )
        parser.add_argument("--workload", action="append", default=[], help="workload id; repeatable")
        parser.add_argument("--all", action="store_true", help="every workload of the fleet")

    def handle(self, *args, **o):
        selection: dict = {}
        if o["label"]:
            selection["labels"] = o["label"]
        if o["workload"]:
            selection["workload_ids"] = o["workload"]
        if o["all"]:
            selection["all"] = True
        intent = mode_change_create(actor=self.actor, data={"selection": selection, "mode": o["mode"]})
        data = mode_change_data(intent)
        self.emit(
            data,
            f"{data['mode']}: {data['resolved_count']} selected, {data['changed_count']} changed (intent {data['id']})",
        )

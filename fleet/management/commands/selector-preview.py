"""What a selector matches now: the same domain function as POST /selectors/preview."""

from controlplane.management.base import PalisadeCommand
from fleet.selectors import selector_preview_request


class Command(PalisadeCommand):
    help = "Show the workloads a label selector matches now."

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument("selector")

    def handle(self, *args, **o):
        data = selector_preview_request(data={"selector": o["selector"]})
        lines = [f"{data['count']} workload(s) match {data['selector']!r}"]
        lines += [f"  {w['id']}  {w['hostname']}" for w in data["workloads"]]
        if data["truncated"]:
            lines.append("  ...")
        self.emit(data, "\n".join(lines))

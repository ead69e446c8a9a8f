"""Read the audit trail: the same function as GET /api/v1/audit-events, newest first."""

from controlplane.audit import OBJECT_TYPES, audit_event_data, audit_events_list
from controlplane.management.base import PalisadeCommand
from controlplane.pagination import MAX_LIMIT


class Command(PalisadeCommand):
    help = "Show the audit trail of operator writes, newest first (read-only)."

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument("--object-type", choices=OBJECT_TYPES)
        parser.add_argument("--object-id", help="one object's history (with --object-type)")
        parser.add_argument("--since", help="RFC 3339 instant, inclusive")
        parser.add_argument("--until", help="RFC 3339 instant, exclusive")
        parser.add_argument("--limit", type=int, default=100, help="at most this many events (default 100)")

    def handle(self, *args, **o):
        wanted = max(o["limit"], 0)
        events, cursor = [], None
        while len(events) < wanted:
            page = audit_events_list(
                object_type=o["object_type"],
                object_id=o["object_id"],
                since=o["since"],
                until=o["until"],
                cursor=cursor,
                limit=min(MAX_LIMIT, wanted - len(events)),
            )
            events.extend(audit_event_data(e) for e in page.items)
            if not (cursor := page.next_cursor):
                break
        lines = [f"{'AT':20}  {'ACTOR':40}  {'ACTION':28}  {'OBJECT':40}  VERSIONS"]
        for e in events:
            versions = f"{e['version_before'] or '-'} -> {e['version_after'] or '-'}"
            target = e["object"]["name"] or e["object"]["id"]
            lines.append(
                f"{e['at'][:19]:20}  {e['actor']['label'][:40]:40}  {e['action'][:28]:28}  {target[:40]:40}  {versions}"
            )
        self.emit({"items": events}, "\n".join(lines))

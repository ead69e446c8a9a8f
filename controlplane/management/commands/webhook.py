"""Webhooks on the host: the same domain functions as /api/v1/webhooks (docs/webhooks.md)."""

from controlplane.management.base import PalisadeCommand
from controlplane.pagination import MAX_LIMIT
from controlplane.text import visible
from controlplane.webhooks.outbox import EVENT_TYPES
from controlplane.webhooks.selectors import (
    attempt_data,
    webhook_attempts_list,
    webhook_data,
    webhook_detail_data,
    webhook_get,
    webhook_list,
    webhooks_data,
)
from controlplane.webhooks.services import webhook_create, webhook_delete


class Command(PalisadeCommand):
    help = "Webhooks: create (the signing secret is shown once), list, delete, and a webhook's deliveries."

    def add_arguments(self, parser):
        super().add_arguments(parser)
        sub = self.add_actions(parser)
        create = sub.add_parser("create", help="create a webhook; prints its signing secret once")
        create.add_argument(
            "--url",
            required=True,
            help="https://... (loopback, and plain http, only on a port in PALISADE_WEBHOOK_LOOPBACK_PORTS)",
        )
        create.add_argument(
            "--event",
            action="append",
            dest="events",
            default=[],
            metavar="TYPE",
            help=f"an event type to receive (repeatable): {', '.join(EVENT_TYPES)}; or 'all'",
        )
        create.add_argument("--description", default="")
        sub.add_parser("list", help="list webhooks")
        delete = sub.add_parser("delete", help="delete a webhook and its pending deliveries")
        delete.add_argument("webhook_id")
        deliveries = sub.add_parser("deliveries", help="a webhook's recent delivery attempts, newest first")
        deliveries.add_argument("webhook_id")
        deliveries.add_argument("--limit", type=int, default=50, help="at most this many (1-500, default 50)")

    def do_create(self, options):
        events = list(EVENT_TYPES) if options["events"] == ["all"] else options["events"]
        data = {"url": options["url"], "events": events, "description": options["description"]}
        created = webhook_create(actor=self.actor, data=data)
        record = webhook_data(created.webhook)
        self.emit(
            {"secret": created.secret, "record": record},
            f"{created.secret}\n(webhook {record['id']} to {visible(record['url'])}; "
            "the signing secret is shown once, store it now)",
        )

    def do_list(self, options):
        items, cursor = [], None
        while True:
            page = webhook_list(cursor=cursor, limit=MAX_LIMIT)
            items.extend(webhooks_data(list(page.items)))
            if not (cursor := page.next_cursor):
                break
        lines = [f"{'ID':36}  {'PENDING':7}  {'CREATED':19}  URL / EVENTS"]
        for w in items:
            lines.append(
                f"{w['id']:36}  {w['deliveries']['pending']:7}  {w['created_at'][:19]:19}  {visible(w['url'])}"
            )
            lines.append(f"{'':36}  {'':7}  {'':19}  {', '.join(w['events'])}")
        self.emit({"items": items}, "\n".join(lines))

    def do_delete(self, options):
        record = webhook_data(webhook_delete(actor=self.actor, webhook_id=options["webhook_id"]))
        self.emit(record, f"deleted webhook {record['id']} ({visible(record['url'])})")

    def do_deliveries(self, options):
        limit = max(1, min(options["limit"], MAX_LIMIT))
        webhook = webhook_detail_data(webhook_get(webhook_id=options["webhook_id"]))
        page = webhook_attempts_list(webhook_id=options["webhook_id"], cursor=None, limit=limit)
        attempts = [attempt_data(a) for a in page.items]
        lines = [
            f"webhook {webhook['id']}: {webhook['deliveries']['pending']} pending",
            f"{'AT':19}  {'EVENT':40}  {'TYPE':34}  {'#':>3}  {'STATUS':6}  {'MS':>6}  OUTCOME",
        ]
        for a in attempts:
            lines.append(
                f"{a['at'][:19]:19}  {a['event']['id']:40}  {a['event']['type']:34}  {a['attempt'] or '-'!s:>3}  "
                f"{a['status_code'] or '-'!s:6}  {a['duration_ms']:6}  {a['outcome']}"
                + (f"  {visible(a['error'])}" if a["error"] else "")
            )
        self.emit({"webhook": webhook, "items": attempts}, "\n".join(lines))

"""Mint, list and revoke operator tokens: the same domain functions as /api/v1/operator-tokens."""

from controlplane.api.operator_tokens import operator_token_data
from controlplane.auth.selectors import operator_token_list
from controlplane.auth.services import operator_token_mint, operator_token_revoke
from controlplane.management.base import PalisadeCommand
from controlplane.pagination import MAX_LIMIT


class Command(PalisadeCommand):
    help = "Operator tokens for automation: mint (the plaintext is shown once), list, revoke."

    def add_arguments(self, parser):
        super().add_arguments(parser)
        sub = self.add_actions(parser)
        mint = sub.add_parser("mint", help="mint a token; prints its plaintext once")
        mint.add_argument("--name", required=True)
        mint.add_argument("--expires-at", help="RFC 3339 instant, e.g. 2027-01-31T00:00:00Z")
        sub.add_parser("list", help="list tokens: prefix and metadata")
        revoke = sub.add_parser("revoke", help="revoke a token; it is refused from the next request on")
        revoke.add_argument("token_id")

    def do_mint(self, options):
        data = {"name": options["name"]}
        if options["expires_at"]:
            data["expires_at"] = options["expires_at"]
        minted = operator_token_mint(actor=self.actor, data=data)
        record = operator_token_data(minted.token)
        self.emit(
            {"token": minted.secret, "record": record},
            f"{minted.secret}\n(token {record['name']} id {record['id']}; shown once, store it now)",
        )

    def do_list(self, options):
        tokens, cursor = [], None
        while True:
            page = operator_token_list(cursor=cursor, limit=MAX_LIMIT)
            tokens.extend(operator_token_data(t) for t in page.items)
            if not (cursor := page.next_cursor):
                break
        lines = [
            f"{'ID':36}  {'PREFIX':12}  {'NAME':20}  {'CREATED':20}  {'LAST USED':20}  {'EXPIRES':20}  STATE"
        ]
        for t in tokens:
            state = "revoked" if t["revoked_at"] else "active"
            lines.append(
                f"{t['id']:36}  {t['prefix']:12}  {t['name'][:20]:20}  {t['created_at'][:19]:20}  "
                f"{(t['last_used_at'] or '-')[:19]:20}  {(t['expires_at'] or 'never')[:19]:20}  {state}"
            )
        self.emit({"items": tokens}, "\n".join(lines))

    def do_revoke(self, options):
        record = operator_token_data(operator_token_revoke(actor=self.actor, token_id=options["token_id"]))
        self.emit(record, f"revoked {record['name']} ({record['prefix']})")

"""Mint, list and revoke provisioning tokens: the same domain functions as /api/v1/provisioning-tokens."""

from django.core.management.base import CommandError

from controlplane.management.base import PalisadeCommand
from controlplane.pagination import MAX_LIMIT
from fleet.api.provisioning_tokens import provisioning_token_data
from fleet.provisioning import provisioning_token_list, provisioning_token_mint, provisioning_token_revoke


def _labels(pairs: list[str] | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    for pair in pairs or []:
        key, equals, value = pair.partition("=")
        if not equals:
            raise CommandError(f"--label {pair!r}: expected KEY=VALUE (VALUE may be empty: KEY=)")
        if key in labels:
            raise CommandError(f"--label {key!r} is given twice")
        labels[key] = value
    return labels


class Command(PalisadeCommand):
    help = (
        "Provisioning tokens for enrolling agents: mint (the enrolment bundle and token are shown once), "
        "list, revoke."
    )

    def add_arguments(self, parser):
        super().add_arguments(parser)
        sub = self.add_actions(parser)
        mint = sub.add_parser("mint", help="mint a token; prints its enrolment bundle once")
        mint.add_argument("--description", required=True, help="what the token is for (1-1000 characters)")
        mint.add_argument("--expires-at", help="RFC 3339 instant, e.g. 2027-01-31T00:00:00Z (default: never)")
        mint.add_argument("--max-uses", type=int, help="how many enrolments it admits (default: unlimited)")
        mint.add_argument(
            "--label",
            action="append",
            metavar="KEY=VALUE",
            help="a label given to every workload the token enrols; repeatable",
        )
        mint.add_argument(
            "--workload-id",
            help="mint a one-use token that re-enrols this workload only (no labels; it enrols nothing else)",
        )
        sub.add_parser("list", help="list tokens: prefix and metadata")
        revoke = sub.add_parser("revoke", help="revoke a token; it enrols nothing from now on")
        revoke.add_argument("token_id")

    def do_mint(self, options):
        data = {"description": options["description"]}
        if options["expires_at"]:
            data["expires_at"] = options["expires_at"]
        if options["max_uses"] is not None:
            data["max_uses"] = options["max_uses"]
        if options["label"]:
            data["labels"] = _labels(options["label"])
        if options["workload_id"]:
            data["workload_id"] = options["workload_id"]
        minted = provisioning_token_mint(actor=self.actor, data=data)
        record = provisioning_token_data(minted.token)
        self.emit(
            {"token": minted.secret, "bundle": minted.bundle, "record": record},
            f"{minted.bundle}\n"
            f"(enrolment bundle for provisioning token {record['prefix']} id {record['id']}; "
            "start the agent with it. It holds the token, which is shown only this once: store it now.)",
        )

    def do_list(self, options):
        tokens, cursor = [], None
        while True:
            page = provisioning_token_list(cursor=cursor, limit=MAX_LIMIT)
            tokens.extend(provisioning_token_data(t) for t in page.items)
            if not (cursor := page.next_cursor):
                break
        lines = [
            f"{'ID':36}  {'PREFIX':12}  {'STATE':8}  {'USES':11}  {'CREATED':19}  {'EXPIRES':19}  "
            f"{'WORKLOAD':36}  DESCRIPTION"
        ]
        for t in tokens:
            uses = f"{t['uses']}/{t['max_uses'] if t['max_uses'] is not None else '-'}"
            lines.append(
                f"{t['id']:36}  {t['prefix']:12}  {t['state']:8}  {uses:11}  {t['created_at'][:19]:19}  "
                f"{(t['expires_at'] or 'never')[:19]:19}  {t['workload_id'] or '(any new)':36}  "
                f"{t['description'][:60]}"
            )
        self.emit({"items": tokens}, "\n".join(lines))

    def do_revoke(self, options):
        record = provisioning_token_data(
            provisioning_token_revoke(actor=self.actor, token_id=options["token_id"])
        )
        self.emit(record, f"revoked provisioning token {record['prefix']} ({record['description'][:60]})")

"""Set or reset the operator's password (there is no API for it, by design)."""

import getpass
import sys

from django.core.management.base import CommandError

from controlplane.auth.services import operator_set_password
from controlplane.management.base import PalisadeCommand


class Command(PalisadeCommand):
    help = "Set or reset the operator password: prompted twice, or read from standard input with --stdin."
    json_output = False
    stealth_options = ("input_stream",)  # the input stream, for call_command in tests

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument(
            "--stdin", dest="from_stdin", action="store_true", help="read the password from standard input"
        )

    def handle(self, *args, **options):
        stream = options.get("input_stream") or sys.stdin
        if options["from_stdin"]:
            password = stream.readline().rstrip("\r\n")
        else:
            if not stream.isatty():
                raise CommandError(
                    "standard input is not a terminal; use --stdin to read the password from it"
                )
            password = getpass.getpass("New operator password: ")
            if getpass.getpass("Repeat it: ") != password:
                raise CommandError("the passwords differ; nothing changed")
        operator_set_password(actor=self.actor, password=password)
        self.stdout.write(
            "Operator password set. Open sessions have ended and login waits are lifted; operator tokens stay valid."
        )

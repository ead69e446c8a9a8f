"""Lift the login throttle: the host's way back in when guessing has spent the login budget."""

from controlplane.auth.services import login_throttle_reset
from controlplane.management.base import PalisadeCommand


class Command(PalisadeCommand):
    help = (
        "Lift every login wait: of each client address and of all addresses together "
        "(`operator-password` lifts them too)."
    )

    def add_arguments(self, parser):
        super().add_arguments(parser)
        sub = self.add_actions(parser)
        sub.add_parser("reset", help="forget every counted failed login; the next login is verified at once")

    def do_reset(self, options):
        addresses = login_throttle_reset(actor=self.actor)
        self.emit(
            {"addresses": addresses},
            f"Login throttle lifted ({addresses} client addresses had counted failures).",
        )

"""Who is acting: passed to every write so intents and logs can say who asked."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Actor:
    # "session", "token", "cli", "agent" (an enrolment at the agent gateway) or "system" (the control
    # plane on its own: a mode change put back when its deadline passed unconfirmed)
    kind: str
    label: str  # e.g. "token ci-deploy (pal_op_Ab12)" or "host command line"
    token_id: str | None = None
    session_id: int | None = None

    @property
    def is_authenticated(self) -> bool:  # lets DRF's IsAuthenticated accept the actor as request.user
        return True

    def __str__(self) -> str:
        return self.label


CLI_ACTOR = Actor(kind="cli", label="host command line")
SYSTEM_ACTOR = Actor(kind="system", label="system")


def cli_actor(argv: Sequence[str]) -> Actor:
    """A host command, named by its command line (the audit trail shows exactly what was run)."""
    return Actor(kind="cli", label=("host: " + shlex.join(["manage.py", *argv[1:]]))[:300])

"""Policy from evidence: the same domain functions as POST /api/v1/policies/impact. One action per
method `do_<action>`."""

from __future__ import annotations

from controlplane.management.base import PalisadeCommand
from policy.management.impact import add_impact_action, run_impact


class Command(PalisadeCommand):
    help = "Policy from evidence: the impact of a draft policy over stored flows."

    def add_arguments(self, parser):
        super().add_arguments(parser)
        actions = self.add_actions(parser)
        add_impact_action(actions)

    def do_impact(self, o):
        run_impact(self, o)

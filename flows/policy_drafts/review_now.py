"""The review before enforcing, with a second verdict beside it: the recorded would-block groups
judged against the policy in force now (classifier.py), as the enforce panel judges them. The review
(flows/selectors.py `simulation_review`) judges the decisions recorded then; a rule saved since may
admit what was recorded would-block, so the two can differ, and each says which it judges."""

from __future__ import annotations

from datetime import datetime

from flows.choices import Direction
from flows.policy_drafts.classifier import FlowKeyClassifier
from flows.policy_drafts.draft import in_force_load
from flows.selectors import simulation_review

RECORDED = "the decisions recorded in the range"
NOW = "the policy in force now"
WOULD_BLOCK_REASON = "would-block group"


def _reasons_now(reasons: list[str], refused_now: int) -> list[str]:
    """The review's reasons with its would-block one judged now: the same, bar that count."""
    kept = [r for r in reasons if WOULD_BLOCK_REASON not in r]
    if refused_now:
        many = refused_now != 1
        kept.insert(
            0,
            f"{refused_now} would-block group{'s' if many else ''} that the policy in force now would "
            f"still refuse: enforcing would block {'them' if many else 'it'}",
        )
    return kept


def simulation_review_now(
    *, selected, start: datetime, end: datetime, direction: str = Direction.INBOUND
) -> dict:
    """`simulation_review`, and `now`: its verdict with the would-block groups judged against the
    policy in force now (those a rule saved since admits no longer count), each by its own direction's
    chain."""
    review = simulation_review(selected=selected, start=start, end=end, direction=direction)
    judge = FlowKeyClassifier(in_force_load())
    rows = review["would_block_rows"]
    # A row carries its direction only when read with `any`.
    refused = [row for row in rows if not judge.admitted_now({"direction": direction, **row})]
    reasons = _reasons_now(review["reasons"], len(refused))
    review["judged_against"] = RECORDED
    review["now"] = {
        "judged_against": NOW,
        "verdict": "fail" if reasons else "pass",
        "reasons": reasons,
        "would_block_count": len(refused),
        "admitted_since_count": len(rows) - len(refused),
    }
    return review

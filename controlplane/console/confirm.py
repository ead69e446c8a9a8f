"""Asking before a destructive action: a confirmation step page, the same with or without scripting.

A delete or revoke URL answers GET (and a POST that does not carry `confirm=yes`) with a page that
names what will go and what it affects now, with Confirm (a POST carrying `confirm=yes` and the
version it was shown) and Cancel (a link back). Only that POST acts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.console.pages import page
from controlplane.text import counted

CONFIRMED = "yes"


@dataclass
class Confirmation:
    title: str  # "Delete ruleset web"
    summary: str  # one sentence: what goes
    action: str  # where Confirm posts
    cancel: str  # where Cancel leads, unchanged
    button: str = "Delete"
    consequences: list[str] = field(default_factory=list)
    fields: dict[str, str] = field(default_factory=dict)  # hidden inputs (the version shown)


def confirmed(request) -> bool:
    return request.method == "POST" and request.POST.get("confirm") == CONFIRMED


def ask(request, confirmation: Confirmation):
    return page(request, "console/confirm.html", {"confirm": confirmation, "confirmed_value": CONFIRMED})


def scope_reach(api, ruleset: dict) -> tuple[str, list[str]]:
    """How many workloads a ruleset protects now (its scope's workloads, all pages, through the API)
    and what deleting its rules does to each mode: a clause for the summary and the consequences."""
    scope = ruleset.get("scope") or ""
    listing = api.get_all("/workloads", params={"label": [scope]} if scope else {})
    if not listing.ok:
        return "its scope could not be read now", [listing.problem.get("detail", "")]
    by_mode: dict[str, int] = {}
    for workload in listing.data["items"]:
        by_mode[workload["mode"]] = by_mode.get(workload["mode"], 0) + 1
    total = len(listing.data["items"])
    if not ruleset.get("enabled", True):
        return (
            f"it is disabled, so it protects no workload now (its scope selects {counted(total, 'workload')})",
            [],
        )
    consequences = []
    if by_mode.get("enforced"):
        consequences.append(
            f"{counted(by_mode['enforced'], 'enforced workload')}: connections that only these rules admit are "
            "blocked there as soon as the change is applied."
        )
    if by_mode.get("simulation"):
        consequences.append(
            f"{counted(by_mode['simulation'], 'workload')} in simulation: those connections show as would-block."
        )
    if by_mode.get("visibility"):
        consequences.append(
            f"{counted(by_mode['visibility'], 'workload')} in visibility: nothing changes on the host."
        )
    return f"it protects {counted(total, 'workload')} now", consequences

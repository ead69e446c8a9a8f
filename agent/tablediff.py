"""What another process changed in the owned table, counted from the kernel's notifications and told
in a short line for the operator ("chain input: 1 rule added; set allow_v4_3: 1 element added").

Pure: no kernel, no I/O, so the wording is tested on its own (tests/agent/test_tablediff.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

ADDED, REMOVED, CHANGED = "added", "removed", "changed"
MAX_DESCRIPTION_CHARS = 500  # a flush of a 10,000-rule table stays one readable line

# What each kind of object holds, for "chain input: 2 rules added"; a change to the object itself
# ("chain extra added") has no member.
_MEMBERS = {"rule": ("rule", "rules"), "element": ("element", "elements")}


@dataclass
class Changes:
    """Counts of (object kind, object name, member or "" for the object itself, verb)."""

    counts: Counter[tuple[str, str, str, str]] = field(default_factory=Counter)

    def add(self, kind: str, name: str, verb: str, member: str = "", n: int = 1) -> None:
        if n > 0:
            self.counts[(kind, name, member, verb)] += n

    def update(self, other: Changes) -> None:
        self.counts.update(other.counts)

    def __bool__(self) -> bool:
        return bool(self.counts)

    def total(self) -> int:
        return sum(self.counts.values())


def describe(changes: Changes) -> str:
    """One line, objects in the order they were first touched, each object's members together."""
    own: dict[tuple[str, str], list[str]] = {}
    members: dict[tuple[str, str], list[str]] = {}
    for (kind, name, member, verb), n in changes.counts.items():
        own.setdefault((kind, name), [])
        members.setdefault((kind, name), [])
        if member:
            singular, plural = _MEMBERS.get(member, (member, member + "s"))
            members[kind, name].append(f"{n} {singular if n == 1 else plural} {verb}")
        else:
            own[kind, name].append(verb if n == 1 else f"{verb} {n} times")
    pieces = []
    for (kind, name), verbs in own.items():
        text = "table" if kind == "table" else f"{kind} {name}"
        if verbs:
            text += " " + " and ".join(verbs)
        if members[kind, name]:
            text += ": " + ", ".join(members[kind, name])
        pieces.append(text)
    line = "; ".join(pieces) or "no difference"
    if len(line) > MAX_DESCRIPTION_CHARS:
        line = line[: MAX_DESCRIPTION_CHARS - 5].rsplit(";", 1)[0] + "; ..."
    return line

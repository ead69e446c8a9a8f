"""`manage.py policy save`: the same function as POST /api/v1/policies/drafts, a draft saved all or
nothing. It reads a draft (`services`, `address_groups`, `rulesets`) or the whole answer of
`policy suggest --answer`, whose draft it saves unchanged."""

from __future__ import annotations

from flows.policy_drafts.draft_save import LISTS, policy_draft_save

SUGGESTION_KEYS = ("evidence", "coverage")  # members only a suggestion's answer has


def add_save_action(actions) -> None:
    save = actions.add_parser(
        "save",
        help="save a draft (services, address groups, rulesets; or `policy suggest --answer`'s whole "
        "answer) in one transaction: all or nothing",
    )
    save.add_argument("file", help="JSON file of the draft, or - for standard input")


def draft_of(data):
    """The draft of a suggestion's whole answer; anything else as it is (the function judges it)."""
    if isinstance(data, dict) and all(key in data for key in SUGGESTION_KEYS):
        return {key: data.get(key, []) for key, _, _ in LISTS}
    return data


def save_text(saved: dict) -> str:
    lines = []
    for key, _, _ in LISTS:
        for item in saved[key]:
            lines.append(f"created {key[:-1].replace('_', ' ')} {item['name']!r} ({item['id']})")
    return "\n".join(lines) or "nothing to save"


def run_save(command, o) -> None:
    saved = policy_draft_save(actor=command.actor, data=draft_of(command.read_json_input(o["file"])))
    command.emit(saved, save_text(saved))

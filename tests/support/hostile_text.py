"""Text a compromised agent may send to drive an operator's terminal or reorder what a page shows, and
the check that a piece of output shows none of it raw."""

from __future__ import annotations

import unicodedata

# Each at most 16 characters: a gap's `lost` names are that long at most.
HOSTILE = [
    "\x1b[2J\x1b[H",  # CSI: clear the screen, cursor home
    "\x1b]0;pwned\x07",  # OSC: retitle the terminal, ended by BEL
    "ok\rforged",  # CR: overwrite the line shown
    "nul\x00del\x7f",
    "\x9b31mc1",  # C1 CSI
    "\u202eevil",  # bidi override: right-to-left
    "\u2066iso\u2069\u200b",  # bidi isolate, zero-width space
    "line\u2028sep",  # a line separator
    "lone\ud800",  # a lone surrogate: JSON admits it, UTF-8 does not
    "two\nlines\tx",
]
HOSTILE_TEXT = "".join(HOSTILE)
UNSAFE = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def unsafe_in(text: str, *, layout: str = "") -> list[str]:
    """The control, format, separator or surrogate characters in `text`, but those of `layout`."""
    return [char for char in text if char not in layout and unicodedata.category(char) in UNSAFE]


def assert_shown_harmlessly(output: str, *, layout: str = "\n") -> None:
    found = unsafe_in(output, layout=layout)
    assert not found, f"raw {sorted(set(found))!r} in {output[:300]!r}"

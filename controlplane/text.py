"""Text made harmless to show: what an agent sends (a gap's `lost` names, its version, its error texts)
may carry ESC and other control characters that drive a terminal (clear it, move the cursor, retitle
it, forge lines) or bidi overrides that reorder what a page or a terminal shows. Each such character is
written as a visible escape in Python's notation, `\\x1b`, `\\u202e`, `\\U000e0001`:

- control characters: C0 (U+0000-001F), DEL (U+007F), C1 (U+0080-009F);
- format characters (Unicode category Cf): the bidi embeddings, overrides and isolates (U+202A-202E,
  U+2066-2069), the marks (U+200E, U+200F, U+061C), zero-width ones, tags;
- line and paragraph separators (U+2028, U+2029), and lone surrogates (JSON admits them; UTF-8 not).

Ingestion escapes agents' free text so (flows/reports.py, fleet/sync.py, fleet/credentials.py), and
every human-readable command output escapes it again (controlplane/management/base.py), for text
stored before, and for anyone else's.
"""

from __future__ import annotations

import re
import unicodedata

UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_PLAIN = re.compile(r"[\x20-\x7e]*")  # printable ASCII: nothing to look at character by character


def is_unsafe(char: str) -> bool:
    return unicodedata.category(char) in UNSAFE_CATEGORIES


def escaped(char: str) -> str:
    point = ord(char)
    if point <= 0xFF:
        return f"\\x{point:02x}"
    return f"\\u{point:04x}" if point <= 0xFFFF else f"\\U{point:08x}"


def visible(text: str, *, keep: str = "") -> str:
    """`text` with every control, format or separator character but those in `keep` (e.g. "\\n\\t" for a
    multi-line error) escaped."""
    if _PLAIN.fullmatch(text):
        return text
    return "".join(escaped(char) if char not in keep and is_unsafe(char) else char for char in text)


def has_unsafe(text: str) -> bool:
    return not _PLAIN.fullmatch(text) and any(is_unsafe(char) for char in text)


def counted(n: int, noun: str, nouns: str | None = None) -> str:
    """A count and its noun, singular for one: "1 peer", "3 peers" (`nouns` where adding an s is wrong)."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"

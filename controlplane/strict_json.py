"""JSON as the service admits it, for the API and the host commands alike.

`json.loads` accepts things that later fail far from the request: a body nested thousands of levels
deep raises RecursionError, a lone surrogate (`"\\ud800"`) decodes and then fails the database write,
NUL is refused by PostgreSQL but stored by SQLite (so the data could not move), a 5,000-digit number
raises an error naming a Python setting, and NaN/Infinity are not JSON at all. Every one of those is
refused here, with a neutral message, before any domain code sees the data.
"""

from __future__ import annotations

import json
import re
from itertools import chain
from typing import Any

from controlplane.problems import Problem

MAX_DEPTH = 32  # the deepest request body of the API is a ruleset's rules' sources: about 6
MAX_NUMBER_DIGITS = 40  # far beyond any count or port the API takes

_SURROGATE = re.compile("[\ud800-\udfff]")
# The parser's hooks cost a Python call per number: most of the parse of a flow report (a few hundred
# numbers). Text with no run of number characters longer than we admit, and no NaN or Infinity, parses
# the same without them; a byte translation finds such runs ten times faster than a regex scan.
_NUMBER_CHARACTERS = bytes(ord("#") if chr(i) in "0123456789.eE+-" else ord(" ") for i in range(256))
_TOO_LONG_RUN = b"#" * (MAX_NUMBER_DIGITS + 1)


def _needs_hooks(raw: bytes) -> bool:
    # A one-byte search is a memchr, twenty times faster on a flow report than the word's own search:
    # without a capital N (or I) there is no NaN (or Infinity), and a report usually has neither.
    return (
        (b"N" in raw and b"NaN" in raw)
        or (b"I" in raw and b"Infinity" in raw)
        or _TOO_LONG_RUN in raw.translate(_NUMBER_CHARACTERS)
    )


def _has_escape(raw: bytes) -> bool:
    """Whether UTF-8 text holds a \\u escape: its bytes do exactly when its decoded text does (UTF-8
    encodes ASCII as itself, and no other character's bytes are ASCII), and a memchr for the backslash
    first skips the search in text without one (most flow reports), where the text's search cost
    10 us a report."""
    return b"\\" in raw and b"\\u" in raw


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_int(text: str) -> int:
    if len(text) > MAX_NUMBER_DIGITS:
        raise ValueError("a number has too many digits")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_DIGITS:
        raise ValueError("a number has too many digits")
    return float(text)


def json_loads_strict(raw: bytes | str, *, what: str = "The body") -> Any:
    """Parse UTF-8 JSON, or raise a `malformed-request` problem that says why in plain words."""
    from_utf8 = isinstance(raw, bytes)
    if from_utf8:
        hooks, texts = _needs_hooks(raw), _has_escape(raw)
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise Problem("malformed-request", f"{what} is not UTF-8 text.") from None
    else:
        hooks = _needs_hooks(raw.encode("utf-8", "surrogatepass"))
        texts = "\\u" in raw or _SURROGATE.search(raw) is not None
    try:
        if hooks:
            data = json.loads(
                raw, parse_constant=_refuse_constant, parse_int=_parse_int, parse_float=_parse_float
            )
        else:
            data = json.loads(raw)
    except RecursionError:
        raise Problem("malformed-request", f"{what} is nested more than {MAX_DEPTH} levels deep.") from None
    except json.JSONDecodeError as error:
        raise Problem(
            "malformed-request",
            f"{what} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}.",
        ) from None
    except ValueError as error:
        raise Problem("malformed-request", f"{what} is not valid JSON: {error}.") from None
    # A decoded string can hold NUL or a lone surrogate only through a \u escape (a raw control
    # character is already refused by the parser), or a surrogate already in the text (never in text
    # decoded from UTF-8, which refuses them): without either, only the depth is left to check, and the
    # strings need not be visited (flow reports are large). `texts` says whether either may be there.
    if texts:
        decoded_values_check(data, what)
    else:
        _depth_check(data, what)
    return data


def _depth_check(data: Any, what: str) -> None:
    """`decoded_values_check` without the strings: the containers a level at a time. A level's values
    are gathered in C (`chain`), and a level whose values hold no container (a flow report's fifty
    groups' fields) is told so by the set of their classes, without a Python step per value."""
    level, depth = ([data] if data.__class__ in _CONTAINERS else []), 1
    while level:
        values = list(chain.from_iterable(v.values() if v.__class__ is dict else v for v in level))
        if _CONTAINERS_SET.isdisjoint(set(map(type, values))):
            return
        if depth >= MAX_DEPTH:
            raise Problem("malformed-request", f"{what} is nested more than {MAX_DEPTH} levels deep.")
        level, depth = [item for item in values if item.__class__ in _CONTAINERS], depth + 1


_CONTAINERS = (dict, list)  # what json.loads makes: exactly these classes, never subclasses
_CONTAINERS_SET = frozenset(_CONTAINERS)


def decoded_values_check(data: Any, what: str, *, texts: bool = True) -> None:
    """Depth, and with `texts` NUL and lone surrogates in every key and string, walked without
    recursion (the depth is what is being checked): what `json_loads_strict` checks of what it decoded,
    for data decoded by another parser (a policy file's YAML)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, what)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise Problem("malformed-request", f"{what} is nested more than {MAX_DEPTH} levels deep.")
        if isinstance(value, dict):
            if texts:
                for key in value:
                    _check_text(key, what)
            items = value.values()
        else:
            items = value
        if texts:
            stack.extend((item, depth + 1) for item in items)
        else:
            stack.extend((item, depth + 1) for item in items if isinstance(item, (dict, list)))


def _check_text(text: str, what: str) -> None:
    if "\x00" in text:
        raise Problem(
            "malformed-request", f"{what} contains a NUL character (\\u0000), which no field admits."
        )
    if _SURROGATE.search(text):
        raise Problem(
            "malformed-request", f"{what} contains a lone UTF-16 surrogate escape, which is not a character."
        )

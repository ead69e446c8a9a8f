"""Small helpers for domain input validation: each collects `Finding`s instead of stopping at the
first, so a caller learns every field to fix at once. Both the API and the command line feed the
same parsed JSON through the same domain parser, so both print the same findings."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from controlplane.problems import Finding, ValidationFailed, pointer


class Findings:
    def __init__(self) -> None:
        self.items: list[Finding] = []

    def add(self, path: str, rule: str, message: str) -> None:
        self.items.append(Finding(path, rule, message))

    def extend(self, findings: Iterable[Finding]) -> None:
        self.items.extend(findings)

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self) -> None:
        if self.items:
            raise ValidationFailed(self.items)


MAX_ECHOED_KEY = 128


def is_digits(text: str) -> bool:
    """ASCII digits only: `str.isdigit` also admits characters such as "²" that `int` refuses."""
    return text.isascii() and text.isdigit()


def quoted(text: Any, limit: int = 64) -> str:
    """The caller's text quoted in a message, bounded: messages never echo unbounded input."""
    text = str(text)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def require_object(data: Any, path: str = "") -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ValidationFailed([Finding(path, "type", "Expected a JSON object.")])
    return data


def reject_unknown(
    data: Mapping[str, Any], allowed: Iterable[str], findings: Findings, base: str = ""
) -> None:
    allowed = set(allowed)
    for key in data:
        if key not in allowed:
            # A pointer to an absurdly long name would echo it whole: point at the object instead.
            path = base + pointer(key) if len(key) <= MAX_ECHOED_KEY else base
            findings.add(path, "unknown-field", f"Unknown field {quoted(key)}.")


def take_string(
    data: Mapping[str, Any],
    key: str,
    findings: Findings,
    *,
    base: str = "",
    required: bool = True,
    default: str = "",
    min_length: int = 0,
    max_length: int = 1000,
) -> str:
    path = base + pointer(key)
    if key not in data or data[key] is None:
        if required:
            findings.add(path, "required", f"{key} is required.")
        return default
    value = data[key]
    if not isinstance(value, str):
        findings.add(path, "type", f"{key} must be a string.")
        return default
    if len(value) < min_length:
        findings.add(
            path,
            "too-short",
            f"{key} must not be empty."
            if min_length == 1
            else f"{key} must have at least {min_length} characters.",
        )
    if len(value) > max_length:
        findings.add(path, "too-long", f"{key} must have at most {max_length} characters.")
    elif (position := unsafe_character_at(value)) is not None:
        findings.add(
            path,
            "unsafe-character",
            f"{key} contains U+{ord(value[position]):04X} at position {position}: control and "
            "bidirectional-formatting characters are not admitted (they can disguise text in consoles and terminals).",
        )
    return value


# Bidirectional embeddings, overrides, isolates and marks: text that displays other than it reads.
_BIDI_FORMATTING = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def unsafe_character_at(text: str) -> int | None:
    """The position of the first control (C0, DEL, C1) or bidirectional-formatting character."""
    for position, character in enumerate(text):
        code = ord(character)
        if code < 0x20 or 0x7F <= code <= 0x9F or character in _BIDI_FORMATTING:
            return position
    return None


def take_bool(
    data: Mapping[str, Any], key: str, findings: Findings, *, base: str = "", default: bool
) -> bool:
    if key not in data:
        return default
    value = data[key]
    if not isinstance(value, bool):
        findings.add(base + pointer(key), "type", f"{key} must be true or false.")
        return default
    return value


def take_int(
    data: Mapping[str, Any],
    key: str,
    findings: Findings,
    *,
    base: str = "",
    required: bool = False,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int | None:
    path = base + pointer(key)
    if key not in data or data[key] is None:
        if required:
            findings.add(path, "required", f"{key} is required.")
        return None
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        findings.add(path, "type", f"{key} must be an integer.")
        return None
    if minimum is not None and value < minimum:
        findings.add(path, "out-of-range", f"{key} must be at least {minimum}.")
        return None
    if maximum is not None and value > maximum:
        findings.add(path, "out-of-range", f"{key} must be at most {maximum}.")
        return None
    return value


# RFC 3339's date-time, ASCII digits only: Python's fromisoformat alone also takes ISO 8601's other
# forms (basic format, week dates, hours without minutes, a comma before the fraction, +hhmm).
_RFC3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})"
)


def _agent_form(value: str) -> bool:
    """`YYYY-MM-DDTHH:MM:SS.ffffffZ`, as agents write every instant of a flow report
    (agent/flowreport.py): separators checked here, digits by `fromisoformat`, which takes only ASCII
    digits where this form has them. Such an instant needs neither the pattern below (three times the
    cost of the parse, and a report has two instants a key) nor a conversion to UTC."""
    # The separators at 4, 7, 10, 13, 16 and 19 in one slice: six comparisons cost more than the parse.
    return len(value) == 27 and value[4:20:3] == "--T::." and value[26] == "Z" and value.isascii()


def parse_instant(value: str) -> datetime | None:
    """An RFC 3339 instant with an explicit offset (`Z` or `+hh:mm`), as UTC; None if malformed."""
    if not isinstance(value, str):
        return None
    if _agent_form(value):
        try:
            return datetime.fromisoformat(value)  # in UTC: it ends in Z
        except ValueError:  # a digit out of range (month 13, hour 24), or not a digit
            return None
    if not _RFC3339.fullmatch(value):
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("z", "Z").replace("Z", "+00:00"))
        # 9999-12-31T23:59:59-14:00 is past the last instant a datetime holds in UTC.
        return parsed.astimezone(UTC)
    except (ValueError, OverflowError):
        return None


def take_instant(
    data: Mapping[str, Any], key: str, findings: Findings, *, base: str = "", required: bool = False
) -> datetime | None:
    path = base + pointer(key)
    if key not in data or data[key] is None:
        if required:
            findings.add(path, "required", f"{key} is required.")
        return None
    parsed = parse_instant(data[key])
    if parsed is None:
        findings.add(
            path, "instant", f"{key} must be an RFC 3339 instant with an offset, e.g. 2026-01-31T12:00:00Z."
        )
    return parsed


def parsed_together(*parsers: Callable[[], Any]) -> list[Any]:
    """Each parser's result, in order; if any refuse, one validation problem with every finding of
    every parser, so that a request with several bad parameters is fixed in one round."""
    results, findings = [], []
    for parse in parsers:
        try:
            results.append(parse())
        except ValidationFailed as failed:
            findings.extend(failed.findings)
            results.append(None)
    if findings:
        raise ValidationFailed(findings)
    return results

"""Small helpers for domain input validation: each collects `Finding`s instead of stopping at the
first, so a caller learns every field to fix at once. Both the API and the command line feed the
same parsed JSON through the same domain parser, so both print the same findings."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
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


def require_object(data: Any, path: str = "") -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ValidationFailed([Finding(path, "type", "Expected a JSON object.")])
    return data


def reject_unknown(data: Mapping[str, Any], allowed: Iterable[str], findings: Findings, base: str = "") -> None:
    allowed = set(allowed)
    for key in data:
        if key not in allowed:
            findings.add(base + pointer(key), "unknown-field", f"Unknown field {key!r}.")


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
            f"{key} must not be empty." if min_length == 1 else f"{key} must have at least {min_length} characters.",
        )
    if len(value) > max_length:
        findings.add(path, "too-long", f"{key} must have at most {max_length} characters.")
    return value


def take_bool(data: Mapping[str, Any], key: str, findings: Findings, *, base: str = "", default: bool) -> bool:
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


def parse_instant(value: str) -> datetime | None:
    """An RFC 3339 instant with an explicit offset (`Z` or `+hh:mm`), as UTC; None if malformed."""
    if not isinstance(value, str) or len(value) < 20:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("z", "Z").replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None or "T" not in value.upper():
        return None
    return parsed.astimezone(timezone.utc)


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
        findings.add(path, "instant", f"{key} must be an RFC 3339 instant with an offset, e.g. 2026-01-31T12:00:00Z.")
    return parsed

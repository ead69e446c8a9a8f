"""Conditional writes: versions, ETags and If-Match.

Every versioned object stores an integer `version` that moves on each write; the API shows it as an
opaque string. The domain compares the caller's expected version with the stored one inside the write's
transaction, holding the row lock, so of two writers holding the same version exactly one wins.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Model, QuerySet

from controlplane.lookups import get_or_not_found
from controlplane.problems import Problem


def version_text(version: int) -> str:
    return str(version)


def etag(version: int) -> str:
    return f'"{version_text(version)}"'


MAX_IF_MATCH_LENGTH = 200  # versions are short; a longer header is not one of ours

# What a weak entity tag becomes: RFC 9110 compares If-Match strongly, so a weak tag never matches.
_NEVER_MATCHES = "W/"


def if_match_from_header(header: str | None) -> str:
    """The version an `If-Match` header carries; 428 when there is none."""
    if header is None or not header.strip():
        raise Problem(
            "precondition-required", "This write requires If-Match carrying the version you read (the ETag)."
        )
    value = header.strip()
    if len(value) > MAX_IF_MATCH_LENGTH:
        raise Problem("malformed-request", f"If-Match is longer than {MAX_IF_MATCH_LENGTH} characters.")
    if value == "*":
        raise Problem(
            "precondition-required", "If-Match must carry the version you read; `*` is not accepted."
        )
    if "," in value:
        raise Problem(
            "precondition-required",
            "If-Match must carry exactly one version (the ETag you read), not a list.",
        )
    if value.startswith("W/"):
        return _NEVER_MATCHES
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    return value


def locked_for_write(queryset: QuerySet, *, pk: Any, expected_version: str, what: str) -> Model:
    """The row, locked until the transaction ends, if its version is still `expected_version`.

    Must run inside `transaction.atomic()`. 404 when it does not exist, 412 when its version moved.
    """
    obj = get_or_not_found(queryset, pk, what=what, for_update=True)
    check_version(current=obj.version, expected=expected_version, what=what)
    return obj


def check_version(*, current: int, expected: str, what: str) -> None:
    if version_text(current) != expected:
        detail = (
            f"A weak ETag never matches If-Match; send the {what}'s version {version_text(current)} as a strong ETag."
            if expected == _NEVER_MATCHES
            else f"The {what} changed since you read it: it is at version {version_text(current)}."
        )
        raise Problem("precondition-failed", detail, current_version=version_text(current))

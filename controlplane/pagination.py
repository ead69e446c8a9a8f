"""Keyset paging with opaque, signed cursors.

A cursor carries the sort key of the last item of its page and a fingerprint of the list it belongs
to (which list, which filters). A cursor that was tampered with, or that belongs to another list or
filter, is refused with a `validation` problem instead of silently returning the wrong page.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.core import signing
from django.db.models import F, Q, QuerySet
from django.db.models.fields.tuple_lookups import Tuple, TupleGreaterThan, TupleLessThan

from controlplane.problems import Finding, ValidationFailed
from controlplane.validation import is_digits

DEFAULT_LIMIT = 100
MAX_LIMIT = 500
_SALT = "palisade.cursor"


@dataclass(frozen=True)
class Page:
    items: list[Any]
    next_cursor: str | None


@dataclass(frozen=True)
class OrderKey:
    """One sort column: the ORM field, whether it descends, and how to read it off an item."""

    field: str
    descending: bool = False
    read: Callable[[Any], Any] | None = None

    def value_of(self, item: Any) -> Any:
        value = self.read(item) if self.read else getattr(item, self.field)
        return value


def parse_limit(raw: str | None) -> int:
    if raw in (None, ""):
        return DEFAULT_LIMIT
    if not is_digits(raw):  # int() also reads "+5", " 5", "5_0" and other scripts' digits
        raise ValidationFailed([Finding("?limit", "type", "limit must be an integer.")])
    limit = int(raw)
    if not 1 <= limit <= MAX_LIMIT:
        raise ValidationFailed(
            [Finding("?limit", "out-of-range", f"limit must be between 1 and {MAX_LIMIT}.")]
        )
    return limit


def list_fingerprint(name: str, filters: Mapping[str, Any]) -> str:
    canonical = json.dumps([name, filters], sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _encode_value(value: Any) -> Any:
    if hasattr(value, "isoformat"):
        return {"t": value.isoformat()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict) and "t" in value:
        from datetime import datetime

        return datetime.fromisoformat(value["t"])
    return value


def _after(order: Sequence[OrderKey], values: Sequence[Any]) -> Q:
    """Rows strictly after `values` in `order`. When every key runs the same way this is one row
    comparison, `(a, b, c) > (x, y, z)`, which the database answers from the order's index; mixed
    directions need the expanded form (a > x) or (a = x and b > y) or ..."""
    if len({key.descending for key in order}) == 1:
        columns = Tuple(*[F(key.field) for key in order])
        compare = TupleLessThan if order[0].descending else TupleGreaterThan
        return Q(compare(columns, tuple(values)))
    condition = Q()
    for index, key in enumerate(order):
        step = Q(**{f"{key.field}__{'lt' if key.descending else 'gt'}": values[index]})
        for previous, earlier in zip(order[:index], values[:index], strict=True):
            step &= Q(**{previous.field: earlier})
        condition |= step
    return condition


def decode_cursor(cursor: str, fingerprint: str, width: int) -> list[Any]:
    try:
        payload = signing.loads(cursor, salt=_SALT)
    except signing.BadSignature:
        raise ValidationFailed(
            [Finding("?cursor", "cursor-invalid", "The cursor is not one this service issued.")]
        ) from None
    if not isinstance(payload, dict) or payload.get("f") != fingerprint or len(payload.get("k", ())) != width:
        raise ValidationFailed(
            [
                Finding(
                    "?cursor",
                    "cursor-stale",
                    "The cursor belongs to another list or other filters; start again without it.",
                )
            ]
        )
    return [_decode_value(v) for v in payload["k"]]


def paginate(
    queryset: QuerySet, *, order: Sequence[OrderKey], cursor: str | None, limit: int, fingerprint: str
) -> Page:
    """One page of `queryset` in `order`; the last key of `order` must make the order total."""
    queryset = queryset.order_by(*[("-" if k.descending else "") + k.field for k in order])
    if cursor:
        values = decode_cursor(cursor, fingerprint, len(order))
        queryset = queryset.filter(_after(order, values))
    rows = list(queryset[: limit + 1])
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        next_cursor = cursor_encode(fingerprint, [k.value_of(rows[-1]) for k in order])
    return Page(items=rows, next_cursor=next_cursor)


def cursor_encode(fingerprint: str, values: Sequence[Any]) -> str:
    """A signed cursor holding the last key of a page, for the list `fingerprint` names."""
    return signing.dumps(
        {"f": fingerprint, "k": [_encode_value(v) for v in values]}, salt=_SALT, compress=True
    )

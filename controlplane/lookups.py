"""The one way to read an object by id for a request: a `not-found` problem when there is none."""

from __future__ import annotations

import uuid
from typing import Any, TypeVar

from django.db.models import Model, QuerySet

from controlplane.problems import Problem

M = TypeVar("M", bound=Model)


def get_or_not_found(
    source: QuerySet[M] | type[M], object_id: Any, *, what: str, detail: str = "", for_update: bool = False
) -> M:
    """The object of `source` whose UUID primary key is `object_id`, locked with `for_update` (inside
    a transaction). An id that is not a UUID at all is simply not found: the same 404, never a 500."""
    queryset = source.objects.all() if isinstance(source, type) else source
    try:
        key = uuid.UUID(str(object_id))
    except ValueError:
        key = None
    if for_update:
        queryset = queryset.select_for_update()
    found = queryset.filter(pk=key).first() if key is not None else None
    if found is None:
        raise Problem("not-found", detail or f"No {what} {object_id}.")
    return found

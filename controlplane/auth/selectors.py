"""Reads of operator authentication."""

from __future__ import annotations

from controlplane.auth.models import Operator, OperatorToken
from controlplane.pagination import OrderKey, Page, list_fingerprint, paginate

OPERATOR_TOKEN_ORDER = (OrderKey("created_at"), OrderKey("id", read=lambda t: str(t.id)))


def operator_exists() -> bool:
    return Operator.objects.filter(id=1).exists()


def operator_token_list(*, cursor: str | None, limit: int) -> Page:
    return paginate(
        OperatorToken.objects.all(),
        order=OPERATOR_TOKEN_ORDER,
        cursor=cursor,
        limit=limit,
        fingerprint=list_fingerprint("operator-tokens", {}),
    )

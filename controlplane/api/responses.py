"""Small response helpers shared by every API view."""

from __future__ import annotations

from typing import Any

from rest_framework.response import Response

from controlplane.conditional import etag, if_match_from_header
from controlplane.pagination import Page, parse_limit


def versioned(data: dict[str, Any], version: int, *, status: int = 200) -> Response:
    response = Response(data, status=status)
    response["ETag"] = etag(version)
    return response


def expected_version(request) -> str:
    return if_match_from_header(request.META.get("HTTP_IF_MATCH"))


def page_params(request) -> tuple[str | None, int]:
    return request.query_params.get("cursor") or None, parse_limit(request.query_params.get("limit"))


def page_response(page: Page, items: list[Any], key: str = "items") -> Response:
    return Response({key: items, "next_cursor": page.next_cursor})

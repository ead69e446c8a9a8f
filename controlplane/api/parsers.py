"""The API's one request parser: JSON in UTF-8 (RFC 8259), parsed strictly (controlplane.strict_json)."""

from __future__ import annotations

from rest_framework.exceptions import UnsupportedMediaType
from rest_framework.parsers import BaseParser

from controlplane.strict_json import json_loads_strict


class StrictJSONParser(BaseParser):
    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
        charset = _charset(media_type or "")
        if charset not in ("", "utf-8", "utf8"):
            # A body declared in another charset would be decoded as declared and stored mangled.
            raise UnsupportedMediaType(
                media_type, detail="JSON request bodies must be UTF-8; drop the charset or declare utf-8."
            )
        # The middleware has already refused bodies over PALISADE_MAX_BODY_BYTES.
        return json_loads_strict(stream.read() if stream is not None else b"")


def _charset(media_type: str) -> str:
    for parameter in media_type.split(";")[1:]:
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return ""

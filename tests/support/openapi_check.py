"""Checks a response against the committed OpenAPI document (`docs/openapi.yaml`).

The API's shapes are written twice: documentation serializers in `*/api/schemas.py` and the dicts of
`*/representations.py`. This is what keeps them in agreement: every JSON response a test receives must
be declared for its operation and status, with its content type, and match the declared schema
exactly (objects are closed: a member the document does not name is a mismatch).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator, FormatChecker

DOCUMENT = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
JSON_TYPES = ("application/json", "application/problem+json")


class SchemaMismatch(AssertionError):
    pass


def _as_json_schema(node: Any) -> Any:
    """OpenAPI 3.0 schemas to JSON Schema 2020-12: `nullable`, and closed objects."""
    if isinstance(node, list):
        return [_as_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    schema = {key: _as_json_schema(value) for key, value in node.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    if schema.pop("nullable", False):
        if "enum" in schema:
            schema["enum"] = [*schema["enum"], None]
        if isinstance(schema.get("type"), str):
            schema["type"] = [schema["type"], "null"]
        elif "type" not in schema:
            schema = {"anyOf": [schema, {"type": "null"}]}
    return schema


@dataclass(frozen=True)
class _Operation:
    method: str
    pattern: re.Pattern
    template: str
    responses: dict


class OpenAPIDocument:
    def __init__(self, document: dict):
        self.components = _as_json_schema(document.get("components", {}))
        self.operations: list[_Operation] = []
        for template, operations in document["paths"].items():
            pattern = re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$")
            for method, operation in operations.items():
                if isinstance(operation, dict) and "responses" in operation:
                    self.operations.append(
                        _Operation(method.upper(), pattern, template, operation["responses"])
                    )
        # /workloads/counts before /workloads/{id}: literal paths win over templates.
        self.operations.sort(key=lambda op: op.template.count("{"))

    def _validator(self, schema: dict) -> Draft202012Validator:
        return Draft202012Validator(
            {"allOf": [_as_json_schema(schema)], "components": self.components},
            format_checker=FormatChecker(),
        )

    def check(self, *, method: str, path: str, status: int, content_type: str, body: bytes) -> None:
        media_type = content_type.split(";")[0].strip().lower()
        if media_type not in JSON_TYPES:
            return
        where = f"{method} {path} -> {status}"
        operation = next(
            (op for op in self.operations if op.method == method and op.pattern.match(path)), None
        )
        if operation is None:
            # Paths or methods the API does not have answer with a problem; nothing else is undocumented.
            if media_type != "application/problem+json":
                raise SchemaMismatch(f"{where}: an undocumented operation answered {media_type}")
            schema: dict = {"$ref": "#/components/schemas/Problem"}
        else:
            declared = operation.responses.get(str(status)) or operation.responses.get("default")
            if declared is None:
                raise SchemaMismatch(
                    f"{where}: status {status} is not declared for {method} {operation.template}"
                )
            content = declared.get("content") or {}
            if media_type not in content:
                raise SchemaMismatch(
                    f"{where}: sent {media_type}, the document declares {sorted(content) or 'no body'}"
                )
            schema = content[media_type].get("schema", {})
        errors = sorted(
            self._validator(schema).iter_errors(json.loads(body)), key=lambda error: list(error.path)
        )
        if errors:
            raise SchemaMismatch(
                f"{where}: the body does not match docs/openapi.yaml:\n"
                + "\n".join(f"  at /{'/'.join(map(str, e.path))}: {e.message[:300]}" for e in errors[:10])
            )


@functools.cache
def committed_document() -> OpenAPIDocument:
    return OpenAPIDocument(yaml.safe_load(DOCUMENT.read_text()))

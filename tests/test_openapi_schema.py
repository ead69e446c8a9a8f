"""The committed OpenAPI document is the one the code generates, and it generates without warnings."""

import io
import re
from pathlib import Path

import pytest
from django.core.management import call_command

COMMITTED = Path(__file__).resolve().parent.parent / "docs" / "openapi.yaml"


def test_committed_schema_has_not_drifted(tmp_path):
    generated = tmp_path / "openapi.yaml"
    call_command(
        "spectacular", "--fail-on-warn", "--validate", "--file", str(generated), stdout=io.StringIO()
    )
    assert generated.read_text() == COMMITTED.read_text(), (
        "docs/openapi.yaml is stale: regenerate it with "
        "`.venv/bin/python manage.py spectacular --fail-on-warn --validate --file docs/openapi.yaml`"
    )


def _document():
    from tests.support.openapi_check import OpenAPIDocument

    item = {
        "type": "object",
        "properties": {"id": {"type": "string"}, "note": {"type": "string", "nullable": True}},
        "required": ["id"],
    }
    return OpenAPIDocument(
        {
            "paths": {
                "/api/v1/things/{id}": {
                    "get": {
                        "responses": {
                            "200": {
                                "content": {
                                    "application/json": {"schema": {"$ref": "#/components/schemas/Thing"}}
                                }
                            }
                        }
                    }
                }
            },
            "components": {"schemas": {"Thing": item}},
        }
    )


def test_the_schema_check_accepts_what_the_document_declares():
    _document().check(
        method="GET",
        path="/api/v1/things/1",
        status=200,
        content_type="application/json",
        body=b'{"id": "1", "note": null}',
    )


@pytest.mark.parametrize(
    "status, content_type, body, complaint",
    [
        (200, "application/json", b'{"id": "1", "extra": 1}', "Additional properties"),
        (200, "application/json", b'{"note": "x"}', "'id' is a required property"),
        (200, "application/json", b'{"id": 1}', "is not of type 'string'"),
        (404, "application/problem+json", b"{}", "status 404 is not declared"),
        (200, "application/problem+json", b'{"id": "1"}', "sent application/problem+json"),
    ],
)
def test_the_schema_check_catches_what_the_document_does_not_declare(status, content_type, body, complaint):
    from tests.support.openapi_check import SchemaMismatch

    with pytest.raises(SchemaMismatch, match=re.escape(complaint)):
        _document().check(
            method="GET", path="/api/v1/things/1", status=status, content_type=content_type, body=body
        )

"""The committed OpenAPI document is the one the code generates, and it generates without warnings."""

import io
from pathlib import Path

from django.core.management import call_command

COMMITTED = Path(__file__).resolve().parent.parent / "docs" / "openapi.yaml"


def test_committed_schema_has_not_drifted(tmp_path):
    generated = tmp_path / "openapi.yaml"
    call_command("spectacular", "--fail-on-warn", "--validate", "--file", str(generated), stdout=io.StringIO())
    assert generated.read_text() == COMMITTED.read_text(), (
        "docs/openapi.yaml is stale: regenerate it with "
        "`.venv/bin/python manage.py spectacular --fail-on-warn --validate --file docs/openapi.yaml`"
    )

"""A bounded schemathesis run of every operation of docs/openapi.yaml against the real serve.

Every answer must be a documented status with its documented content type and schema, and nothing may
be a 5xx. It is bounded (a few examples an operation) so that it runs in every CI; a regression that
fuzzing finds at all tends to show within those.
"""

import warnings
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.serve_process import Site

pytestmark = pytest.mark.e2e

DOCUMENT = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
EXAMPLES_PER_OPERATION = 12
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with Site.fresh(tmp_path_factory.mktemp("fuzz") / "data", migrated=True) as site:
        serve = site.serve()
        yield serve, site.mint_operator_token("fuzz")
        assert serve.stop() == 0
        log = serve.stderr_text()
        assert "Traceback" not in log, log


SCHEMA = schemathesis.openapi.from_path(DOCUMENT)
OPERATIONS = {
    operation.label: operation for operation in (result.ok() for result in SCHEMA.get_all_operations())
}


@pytest.mark.parametrize(
    "mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda mode: mode.value
)
@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_every_operation_answers_as_documented(label, mode, served):
    serve, token = served

    @given(case=OPERATIONS[label].as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def answers_as_documented(case):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the served certificate is self-signed, and this is loopback
            case.call_and_validate(
                base_url=serve.url("operator"),
                headers={"Authorization": f"Bearer {token}"},
                checks=CHECKS,
                verify=False,
                timeout=30,
            )

    answers_as_documented()

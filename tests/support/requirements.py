"""Skips for missing prerequisites that turn into failures where everything must run (CI)."""

import os

import pytest


def require(condition: bool, reason: str) -> None:
    """Skip the test with `reason` unless `condition` holds; fail instead when PALISADE_REQUIRE_ALL=1."""
    if condition:
        return
    if os.environ.get("PALISADE_REQUIRE_ALL") == "1":
        pytest.fail(reason)
    pytest.skip(reason)

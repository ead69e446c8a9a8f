"""serve's reactor thread gets the GIL back within a millisecond of a database thread's turn."""

from __future__ import annotations

import sys

import pytest

from controlplane.management.commands import serve


def test_serve_hands_the_gil_round_every_millisecond():
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)  # the interpreter's own
        serve._switch_interval_tune()
        assert sys.getswitchinterval() == pytest.approx(0.001, abs=1e-6)
    finally:
        sys.setswitchinterval(before)

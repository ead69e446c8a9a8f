"""The boundaries of design.md section 1, checked by import-linter on every run."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "lint-imports"),
            "--config",
            str(ROOT / "pyproject.toml"),
            "--no-cache",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 5 kept, 0 broken." in result.stdout, result.stdout


def test_agent_has_its_own_packaging_metadata():
    import tomllib

    meta = tomllib.loads((ROOT / "agent" / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "palisade-agent"
    assert not any("django" in dep.lower() for dep in meta["project"]["dependencies"])


def test_the_plain_copies_of_the_vocabulary_agree_with_the_choices():
    """The renderer and the agent import no Django, so they keep plain copies of the choices."""
    from agent.protocol import OWNED_TABLE_STATES
    from fleet.choices import Mode, OwnedTableState
    from policy import render_inputs
    from policy.choices import SourceKind

    assert tuple(Mode.values) == render_inputs.MODES
    assert tuple(SourceKind.values) == render_inputs.SOURCE_KINDS
    assert tuple(OwnedTableState.values) == OWNED_TABLE_STATES

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
    assert "Contracts: 4 kept, 0 broken." in result.stdout, result.stdout


def test_agent_has_its_own_packaging_metadata():
    import tomllib

    meta = tomllib.loads((ROOT / "agent" / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "palisade-agent"
    assert not any("django" in dep.lower() for dep in meta["project"]["dependencies"])

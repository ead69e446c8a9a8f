"""The boundaries of docs/architecture.md (the apps, their layers), checked by import-linter on every run."""

import ast
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
    assert "Contracts: 7 kept, 0 broken." in result.stdout, result.stdout


def test_agent_has_its_own_packaging_metadata():
    import tomllib

    meta = tomllib.loads((ROOT / "agent" / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "palisade-agent"
    assert not any("django" in dep.lower() for dep in meta["project"]["dependencies"])


def test_the_agents_own_dependencies_cover_what_it_imports():
    """`pip install ./agent` must give the agent everything it imports: each third-party module of
    agent/ is a dependency in agent/pyproject.toml (nftables comes from Debian's python3-nftables)."""
    import re
    import tomllib
    from importlib.metadata import packages_distributions

    declared = {
        re.split(r"[<>=!~ \[;]", dep, maxsplit=1)[0].lower().replace("_", "-")
        for dep in tomllib.loads((ROOT / "agent" / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    imported = set()
    for path in (ROOT / "agent").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"agent", "__future__", "nftables"}
    distributions = packages_distributions()
    missing = {
        module
        for module in third_party
        if not {d.lower().replace("_", "-") for d in distributions.get(module, [module])} & declared
    }
    assert "prometheus_client" in third_party and missing == set(), missing


def test_the_plain_copies_of_the_vocabulary_agree_with_the_choices():
    """The renderer and the agent import no Django, so they keep plain copies of the choices."""
    from agent.protocol import OWNED_TABLE_STATES
    from fleet.choices import Mode, OwnedTableState
    from policy import render_inputs
    from policy.choices import SourceKind

    assert tuple(Mode.values) == render_inputs.MODES
    assert tuple(SourceKind.values) == render_inputs.SOURCE_KINDS
    assert tuple(OwnedTableState.values) == OWNED_TABLE_STATES


LAYERED_PACKAGES = ("controlplane", "policy", "fleet", "flows")


def _layers_contract_modules() -> set[str]:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["type"] == "layers" and c["name"].startswith("Layers:")]
    return {name.strip() for line in layers["layers"] for name in line.replace("|", ":").split(":")}


def _modules_under(package: str) -> list[str]:
    modules = []
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        # A root package's own __init__ cannot be a layer: naming it would put all its modules in one.
        if len(parts) > 1:
            modules.append(".".join(parts))
    return modules


def _is_bare_package(module: str) -> bool:
    """A package whose modules sit in different layers (controlplane.auth) cannot be named in one; its
    __init__ is exempt while it imports nothing, and so can break no layer."""
    init = ROOT.joinpath(*module.split("."), "__init__.py")
    if not init.exists():
        return False
    tree = ast.parse(init.read_text())
    return not any(isinstance(node, ast.Import | ast.ImportFrom) for node in ast.walk(tree))


def test_every_module_is_in_a_layer():
    """A module that is in no layer is checked by no layer: a new module must be given its place
    (a module is placed by its own name or by a package above it). Migrations, apps, settings and
    commands are listed too, as entry points that Django loads by name and no module imports."""
    listed = _layers_contract_modules()
    unplaced = [
        module
        for package in LAYERED_PACKAGES
        for module in _modules_under(package)
        if not any(module == name or module.startswith(name + ".") for name in listed)
        and not _is_bare_package(module)
    ]
    assert unplaced == [], f"modules in no layer of pyproject.toml's layers contract: {unplaced}"


def test_every_layer_names_a_module():
    """A layer entry left behind by a move or a rename would hide that the new name is unplaced."""
    existing = {m for package in LAYERED_PACKAGES for m in _modules_under(package)}
    stale = sorted(name for name in _layers_contract_modules() if name not in existing)
    assert stale == [], f"layer entries that name no module: {stale}"

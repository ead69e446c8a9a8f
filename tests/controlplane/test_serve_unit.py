"""deploy/palisade-serve.service: a unit systemd accepts, that runs serve unprivileged with room for
its connections."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.requirements import require

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "palisade-serve.service"


def _service() -> dict[str, list[str]]:
    directives: dict[str, list[str]] = {}
    section = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line and not line.startswith("#"):
            key, _, value = line.partition("=")
            directives.setdefault(key, []).append(value)
    return directives


def test_serve_runs_unprivileged_with_a_raised_descriptor_limit_and_hardening():
    service = _service()
    assert service["User"] == ["palisade"] and service["CapabilityBoundingSet"] == [""]
    assert int(service["LimitNOFILE"][0]) >= 4096
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "StateDirectory": "palisade",
    }.items():
        assert service[key] == [value], key
    assert "/var/lib/palisade" in service["ReadWritePaths"][0]
    assert service["ExecStart"][0].endswith("manage.py serve --data-dir /var/lib/palisade")


def test_systemd_accepts_the_unit(tmp_path):
    analyze = shutil.which("systemd-analyze")
    require(analyze is not None, "systemd-analyze is not installed (apt install systemd)")
    # verify checks that ExecStart's program exists: point it at this interpreter.
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/palisade/.venv/bin/python", sys.executable))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


TEMPLATE = UNIT.with_name("palisade-serve@.service")


def test_the_template_runs_each_instance_with_its_own_arguments_and_the_shared_settings(tmp_path):
    text = TEMPLATE.read_text()
    service = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert "EnvironmentFile=/etc/palisade/serve.env" in service
    assert "EnvironmentFile=/etc/palisade/serve-%i.env" in service
    (exec_start,) = [line for line in service if line.startswith("ExecStart=")]
    assert exec_start.endswith("serve --data-dir /var/lib/palisade $PALISADE_SERVE_ARGS")
    # The same hardening as the single unit: only what differs between them differs.
    single = {line for line in UNIT.read_text().splitlines() if line and not line.startswith("#")}
    differs = {line for line in service if line not in single}
    assert {line.partition("=")[0] for line in differs} == {"Description", "EnvironmentFile", "ExecStart"}
    analyze = shutil.which("systemd-analyze")
    require(analyze is not None, "systemd-analyze is not installed (apt install systemd)")
    unit = tmp_path / "palisade-serve@1.service"
    unit.write_text(text.replace("/opt/palisade/.venv/bin/python", sys.executable))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr

"""Debian's Prometheus for tests: `promtool` on an exposition or on alerting rules, and a real server
that scrapes a target and answers queries.

    check_metrics(text)                 # promtool check metrics: the exposition parses and lints clean
    check_rules(path)                   # promtool check rules
    rule_tests_pass(path)               # promtool test rules
    with PrometheusServer(tmp_path, scrape={...}) as prometheus:
        prometheus.wait_for(lambda: prometheus.query("up") ...)

Missing binaries go through require() (deploy/test.sh installs the `prometheus` package).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.requirements import require
from tests.support.serve_process import free_port, terminate

PROMTOOL = "/usr/bin/promtool"
PROMETHEUS = "/usr/bin/prometheus"


def _binary(path: str) -> str:
    found = path if Path(path).exists() else shutil.which(Path(path).name)
    require(found is not None, f"{Path(path).name} is not installed (Debian's prometheus package)")
    return str(found)


def promtool(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([_binary(PROMTOOL), *args], input=input, capture_output=True, text=True, timeout=60)


def check_metrics(exposition: str) -> None:
    """promtool's parse and lint of a text exposition (the output names every problem it finds)."""
    done = promtool("check", "metrics", input=exposition)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
        f"promtool check metrics exited {done.returncode}:\n{done.stdout}{done.stderr}"
    )


def check_rules(path: Path) -> str:
    done = promtool("check", "rules", str(path))
    assert done.returncode == 0, f"promtool check rules {path}:\n{done.stdout}{done.stderr}"
    return done.stdout


def rule_tests_pass(path: Path) -> str:
    done = promtool("test", "rules", str(path))
    assert done.returncode == 0, f"promtool test rules {path}:\n{done.stdout}{done.stderr}"
    return done.stdout


class PrometheusServer:
    """`prometheus` with the scrape jobs given (a job's config, or a list of them), its own storage,
    on a free loopback port."""

    def __init__(
        self, root: Path, *, scrape: dict[str, Any] | list[dict[str, Any]], scrape_interval: str = "1s"
    ):
        self.root = Path(root)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": [
                {"scrape_interval": scrape_interval, **job}
                for job in ([scrape] if isinstance(scrape, dict) else scrape)
            ],
        }
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> PrometheusServer:
        binary = _binary(PROMETHEUS)
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config))
        self.log = (self.root / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.root / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.wait_for(self._ready, timeout=60, what="Prometheus to be ready")
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            terminate(self.process)
        self.log.close()

    def log_text(self) -> str:
        return (self.root / "prometheus.log").read_text()

    def _ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"prometheus exited {self.process.returncode}:\n{self.log_text()}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def api(self, path: str, **params: str) -> Any:
        answer = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = answer.json()
        assert body.get("status") == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's vector: [{"metric": {...labels}, "value": [time, "text"]}, ...]."""
        return self.api("query", query=expr)["result"]

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def wait_for(
        self, condition: Callable[[], Any], *, timeout: float = 30, what: str = "a condition"
    ) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            result = condition()
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"waited {timeout} s for {what}; prometheus said:\n{self.log_text()[-3000:]}"
                )
            time.sleep(0.2)

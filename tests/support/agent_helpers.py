"""Shared pieces of the agent tests: running the CLI, a fake gateway on a background loop, documents."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from agent import outbound_observe
from tests.support.fake_gateway import FakeGateway

REPO = Path(__file__).resolve().parents[2]
ERROR_PREFIX = "palisade-agent: error: "


def document(comment: str = "v1", port: int = 22) -> str:
    """A small valid owned-table document; `comment` makes versions differ."""
    return (
        "table inet palisade {\n"
        f"  # {comment}\n"
        "  chain input {\n"
        "    type filter hook input priority 0; policy accept;\n"
        f"    tcp dport {port} accept\n"
        "  }\n"
        "}\n"
    )


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(name, sorted labels): value} of a Prometheus exposition (the agent's metrics textfile)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """One sample's value in an exposition; None when it has no such sample."""
    return metric_samples(text).get((name, tuple(sorted(labels.items()))))


def run_cli(
    *args: str, input: str | None = None, timeout: float = 60, netns: str | None = None
) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "agent", *args]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        argv, capture_output=True, text=True, input=input, timeout=timeout, env=env, cwd=REPO
    )


def assert_one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """The command failed with exactly one stderr line, `palisade-agent: error: ...`, holding `fragments`."""
    assert done.returncode != 0, done
    lines = done.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{done.stderr}"
    assert lines[0].startswith(ERROR_PREFIX), lines[0]
    assert "Traceback" not in done.stderr
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


class GatewayThread:
    """A FakeGateway on its own event loop in a thread, for blocking code (enrolment, the CLI)."""

    def __init__(self, data_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.gateway: FakeGateway = self.call(FakeGateway(data_dir).start())

    def call(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def bundle(self, uses: int = 1) -> str:
        return self.gateway.bundle(self.gateway.add_token(uses))

    def close(self) -> None:
        self.call(self.gateway.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


_GATEWAY_ELEMENTS = re.compile(
    r"(\tset agent_gateways_v[46] \{\n\t\ttype [^\n]+\n)\t\telements = \{[^}]*\}\n"
)


def as_sent(applied: str | None) -> str | None:
    """The document the agent was sent, from the table it applied: without the gateway sets' elements it
    fills and the observe-only output chain it adds to a document that has none (agent/outbound_observe.py)."""
    if applied is None:
        return None
    text = _GATEWAY_ELEMENTS.sub(r"\1", applied)
    added = "\n\n" + outbound_observe.added_text() + "}\n"
    return text[: -len(added)] + "\n}\n" if text.endswith(added) else text

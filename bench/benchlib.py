"""What every benchmark script does the same way: stopping cleanly, and writing its results."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def exit_on_sigterm() -> None:
    """SIGTERM (a `timeout`, a CI cancel) unwinds like Ctrl-C, so processes, namespaces, databases
    and temporary directories are still cleaned up."""

    def stop(signum, frame):
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)


def results_write(name: str, results: dict) -> None:
    """bench/results/NAME.json, and a line saying so."""
    out = RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {out.relative_to(RESULTS_DIR.parent.parent)}")


def cpu_seconds(pid: int, *, reaped: bool = False) -> float:
    """User + system CPU time of one process so far; with `reaped`, of its children that it waited for
    too (the kernel adds an exited child's time to its parent's when the parent reaps it)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rpartition(")")[2].split()
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if reaped else 0)
    return ticks / os.sysconf("SC_CLK_TCK")

"""The buffer of closed windows and gaps waiting for the control plane's acknowledgement.

Bounded by `max_records` windows (`--flow-buffer-records`): when a window more would not fit, the
oldest are dropped and `buffer_overflow` gaps cover exactly their range (one per run of back-to-back
windows), with how many windows were lost. Gaps are kept until
acknowledged too; they are few (one per incident), so they do not count against the bound.

The buffer lives in the state directory (`flows.json`, written whole to a temporary name and renamed
at every change), so closed windows survive an agent restart. A window re-sent after a lost
acknowledgement keeps its id; the control plane stores it once.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict
from pathlib import Path

from agent.flowwindow import INBOUND, ClosedWindow, Counters, FlowKey, Gap

BUFFER_FILE = "flows.json"


def window_record(window: ClosedWindow) -> dict:
    return {
        "id": window.id,
        "start": window.start,
        "end": window.end,
        "policy_version": window.policy_version,
        "accounting": window.accounting,
        "groups": [{**_key_record(key), **asdict(counters)} for key, counters in window.groups],
    }


def _key_record(key: FlowKey) -> dict:
    """A key as the report carries it: `direction` only when outbound and `failsafe` only when true
    (absent means inbound and no marker, docs/protocol.md), so an inbound key is the bytes it always was
    and a buffer written before either existed reads back the same."""
    record = {"peer": key.peer, "protocol": key.protocol, "port": key.port, "decision": key.decision}
    record["rule"] = key.rule
    if key.direction != INBOUND:
        record["direction"] = key.direction
    if key.failsafe:
        record["failsafe"] = True
    return record


def gap_record(gap: Gap) -> dict:
    return {"id": str(uuid.uuid4()), **asdict(gap)}


def window_from_record(record: dict) -> ClosedWindow:
    groups = []
    for group in record["groups"]:
        key = FlowKey(
            group["peer"],
            group["protocol"],
            group["port"],
            group["decision"],
            group["rule"],
            group.get("direction", INBOUND),
            group.get("failsafe", False),
        )
        counters = Counters(
            group["connection_count"],
            group["first_seen"],
            group["last_seen"],
            group["bytes_in"],
            group["bytes_out"],
        )
        groups.append((key, counters))
    return ClosedWindow(
        record["id"],
        record["start"],
        record["end"],
        record["policy_version"],
        record["accounting"],
        tuple(groups),
    )


def _overflow_gaps(dropped: list[dict]) -> list[Gap]:
    """One `buffer_overflow` gap per run of back-to-back dropped windows: exactly their range (a quiet
    window between two dropped ones was never a window, and lost nothing)."""
    runs: list[list[dict]] = []
    for window in sorted(dropped, key=lambda w: w["start"]):
        if runs and runs[-1][-1]["end"] == window["start"]:
            runs[-1].append(window)
        else:
            runs.append([window])
    return [
        Gap("buffer_overflow", None, run[0]["start"], run[-1]["end"], {"windows": len(run)}) for run in runs
    ]


class FlowBuffer:
    def __init__(self, directory: Path, *, max_records: int):
        if max_records <= 0:
            raise ValueError("the buffer must hold at least one window")
        self.path = Path(directory) / BUFFER_FILE
        self.max_records = max_records
        self.windows: list[dict] = []
        self.gaps: list[dict] = []
        if self.path.exists():
            saved = json.loads(self.path.read_text())
            self.windows, self.gaps = list(saved.get("windows", [])), list(saved.get("gaps", []))

    def _save(self) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        with open(temporary, "w") as file:
            json.dump({"windows": self.windows, "gaps": self.gaps}, file, separators=(",", ":"))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.path)

    def add(self, windows: list[ClosedWindow], gaps: list[Gap]) -> None:
        self.windows.extend(window_record(w) for w in windows)
        self.gaps.extend(gap_record(g) for g in gaps)
        excess = len(self.windows) - self.max_records
        if excess > 0:
            dropped, self.windows = self.windows[:excess], self.windows[excess:]
            self.gaps.extend(gap_record(gap) for gap in _overflow_gaps(dropped))
        if windows or gaps:
            self._save()

    def pending(self) -> tuple[list[dict], list[dict]]:
        """What still waits for an acknowledgement, oldest first."""
        return list(self.windows), list(self.gaps)

    def acknowledge(self, ids: set[str]) -> None:
        """Drop what the control plane acknowledged (stored, or refused as malformed: never re-sent)."""
        before = len(self.windows) + len(self.gaps)
        self.windows = [w for w in self.windows if w["id"] not in ids]
        self.gaps = [g for g in self.gaps if g["id"] not in ids]
        if len(self.windows) + len(self.gaps) != before:
            self._save()

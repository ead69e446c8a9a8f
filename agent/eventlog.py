"""One line per event on stderr, easy to grep from a test or the journal:

2026-11-21T12:00:00.123Z applied version=v7 mode=enforced
2026-11-21T12:00:00.456Z [sim-00002] stream closed code=4100 reason="resend-snapshot"
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import TextIO


def _value(value: object) -> str:
    text = " ".join(str(value).split())  # never break the one-line-per-event promise
    if text and not any(c in text for c in ' "='):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def now_text() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class EventLog:
    def __init__(self, prefix: str = "", stream: TextIO | None = None) -> None:
        self.prefix = f"[{prefix}] " if prefix else ""
        self.stream = stream

    def __call__(self, event: str, **fields: object) -> None:
        parts = [event, *(f"{key}={_value(value)}" for key, value in fields.items() if value is not None)]
        stream = self.stream or sys.stderr
        try:
            stream.write(f"{now_text()} {self.prefix}{' '.join(parts)}\n")
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed stderr must not stop the firewall agent

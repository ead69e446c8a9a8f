"""The one CSV shape of flow evidence, for `manage.py flows --csv` and the console's exports alike.

Pure: it takes the API's JSON documents (a rollup's items, a gap) and knows no model, so the console,
which reads only the API, may import it as the command does. A rollup row's `service` object becomes
two columns, `protocol` and `port`; a gap's `lost` object is its JSON in one cell.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping
from typing import Any

from controlplane.text import visible

# The columns each grouping gives a rollup row, in the order the row representation has them
# (flows.representations.rollup_row_data; tests/flows/test_csv_rows.py holds them together).
ROLLUP_GROUP_COLUMNS = {
    "workload": ("workload_id",),
    "peer": ("peer",),
    "peer_workload": ("peer_workload_id",),
    "service": ("protocol", "port"),
    "decision": ("decision",),
    "direction": ("direction",),
    "rule": ("rule_number", "rule_id", "rule_action"),
    "window": ("window_start",),
    "ruleset": ("ruleset_id",),
}
ROLLUP_SUMS = ("connection_count", "bytes_in", "bytes_out", "first_seen", "last_seen")
GAP_COLUMNS = ("workload_id", "kind", "source", "start", "end", "lost")


def rollup_columns(group_by: Iterable[str]) -> list[str]:
    """The header of a rollup grouped by `group_by` (so that an empty rollup has one too)."""
    chosen = set(group_by)
    keys = [column for name, columns in ROLLUP_GROUP_COLUMNS.items() if name in chosen for column in columns]
    return keys + list(ROLLUP_SUMS)


def rollup_row(item: Mapping[str, Any]) -> dict[str, Any]:
    """A rollup item with its service object as two columns, protocol and port, in its place."""
    return dict(
        pair
        for key, value in item.items()
        for pair in (value.items() if key == "service" and isinstance(value, Mapping) else [(key, value)])
    )


def csv_text(columns: Iterable[str], rows: Iterable[Mapping[str, Any]]) -> str:
    """One line per row under a header; null is an empty cell, an object (a gap's `lost`) is the API's
    JSON in its cell, and text shows agents' control characters escaped (a spreadsheet or a terminal
    shows the file)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(
        {
            key: json.dumps(value, sort_keys=True)
            if isinstance(value, Mapping)
            else visible(value)
            if isinstance(value, str)
            else value
            for key, value in row.items()
        }
        for row in rows
    )
    return out.getvalue()

"""The CSV shape shared by `manage.py flows --csv` and the console's exports matches the rollup row
representation column for column, whatever the grouping."""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import combinations

import pytest

from flows import validation
from flows.csv_rows import csv_text, rollup_columns, rollup_row
from flows.representations import rollup_row_data

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _represented(group_by) -> list[str]:
    sample = {column: EPOCH if column == "start" else None
              for name in group_by for column in validation.GROUP_KEYS[name]}  # fmt: skip
    sample.update(connection_count=0, bytes_in=0, bytes_out=0, first_seen=EPOCH, last_seen=EPOCH)
    return list(rollup_row(rollup_row_data(sample, {})))


@pytest.mark.parametrize(
    "group_by", [list(pair) for size in (1, 2) for pair in combinations(validation.GROUP_KEYS, size)]
    + [list(validation.GROUP_KEYS), list(reversed(validation.GROUP_KEYS))],
)  # fmt: skip
def test_the_columns_are_those_of_the_row_representation(group_by):
    assert rollup_columns(group_by) == _represented(group_by)


def test_a_gap_lost_is_json_and_null_is_empty():
    text = csv_text(["kind", "source", "lost"], [{"kind": "buffer_overflow", "source": None,
                                                   "lost": {"windows": 2, "connections": 7}}])  # fmt: skip
    assert text == 'kind,source,lost\nbuffer_overflow,,"{""connections"": 7, ""windows"": 2}"\n'

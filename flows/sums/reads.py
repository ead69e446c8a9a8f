"""The read plan of the sums: which rows of which span hold a range (`sum_reads`, down the ladder of
flows/sums/ladder.py), and a range's groups added up from them, the windows not summed yet and the
minute rows at its edges (`spans_summed`): on PostgreSQL in the statement that reads them, on SQLite
in Python."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from django.db import connections
from django.db.models import BooleanField, F, Func, Max, Min, Q, Subquery, Sum, UUIDField
from django.db.models.sql.constants import MULTI

from controlplane import clock
from flows.buckets import whole_spans
from flows.models import UnsummedWindow
from flows.sums.ladder import LADDER, NO_RULE, SUMMED, Span, rule_read, sums_due


def key_sums(queryset, columns: list[str]):
    """Rows of `queryset` (minute rows or sums) summed per key of `columns`."""
    return queryset.values(*columns).annotate(
        connection_count=Sum("connection_count"),
        bytes_in=Sum("bytes_in"),
        bytes_out=Sum("bytes_out"),
        first_seen=Min("first_seen"),
        last_seen=Max("last_seen"),
    )


def sum_reads(low: datetime, high: datetime, ladder: tuple[Span, ...] = LADDER) -> list:
    """The read plan: the rows of sums that hold [low, high) (whole blocks), down the ladder
    (flows/sums/ladder.py), longest span first: its whole quarters, the whole hours left beside them, the
    blocks left beside those. Each a plain range of its span's start, which reads only its own
    partitions and index range (a day's range: three or four quarters and a few hours a key)."""
    rung, shorter = ladder[0], ladder[1:]
    whole = whole_spans(low, high, rung.span) if shorter else (low, high)
    if whole is None:
        return sum_reads(low, high, shorter)
    first, last = whole
    reads = (
        [rung.model.objects.filter(**{f"{rung.column}__gte": first, f"{rung.column}__lt": last})]
        if first < last
        else []
    )
    for side_low, side_high in ((low, first), (last, high)):
        if side_low < side_high:
            reads += sum_reads(side_low, side_high, shorter)
    return reads


@dataclass(frozen=True)
class Summed:
    """A range's rows added up by key: at most the bound a read asked for, and how many keys (and
    their connections) there were in all, so that a read past its bound says what it left out."""

    rows: list[dict]
    key_count: int
    connection_count: int

    @property
    def truncated(self) -> bool:
        return self.key_count > len(self.rows)

    @property
    def connections_left_out(self) -> int:
        return self.connection_count - sum(row["connection_count"] for row in self.rows)


def spans_summed(
    *,
    groups,
    selected,
    blocks: tuple[datetime, datetime],
    columns: list[str],
    annotate: Mapping[str, Callable[[], Any]] | None = None,
    conditions: tuple[Q, ...] = (),
    most: int | None = None,
    by_connections: bool = False,
    after: list | None = None,
    **filters,
) -> Summed:
    """Every group of a range that holds a whole ten-minute block, summed by `columns`: its whole
    blocks (`blocks`) from the sums (`sum_reads`), the groups of windows in those not summed yet, and
    the minute rows only at the two edges (under ten minutes each, and the blocks too recent to be
    summed). `groups` are the range's minute rows (flows.selectors.groups_in_range), `selected` its
    workloads (None: the whole fleet), `annotate` the computed columns that `columns` may name (each
    made for every part), `conditions` and `filters` narrow every part by key columns. One statement:
    summing moves windows from the groups read to the sums, and two statements could see a window in
    both or in neither. `most`, `by_connections` and `after` as `added_up` takes them."""
    first_block, last_block = blocks
    # The blocks from here on are not summed yet, bar a round of housekeeping that ran late: read as
    # minute rows at the edge, not window by window from the unsummed list. Exact wherever it falls:
    # the sums are read only before it, and the minute rows only from it on.
    split = min(last_block, max(first_block, sums_due(now=clock.now())))
    groups = groups.filter(*conditions, **filters)
    sums = [part.filter(*conditions, **filters) for part in sum_reads(first_block, split)]
    if selected is not None:
        sums = [part.filter(workload__in=selected) for part in sums]
    for name, made in (annotate or {}).items():
        groups = groups.annotate(**{name: made()})
        sums = [part.annotate(**{name: made()}) for part in sums]
    unsummed = UnsummedWindow.objects.filter(start__gte=first_block, start__lt=split)
    edges = [groups.filter(start__lt=first_block), groups.filter(start__gte=split)]
    within = groups.filter(_windows_among(unsummed, groups.db), start__gte=first_block, start__lt=split)
    first, *rest = [key_sums(part, columns) for part in (*edges, within, *sums)]
    parts = first.union(*rest, all=True)
    return added_up(parts, columns, most=most, by_connections=by_connections, after=after)


def _windows_among(unsummed, alias: str):
    """The filter of the minute rows of the windows `unsummed`. On PostgreSQL the windows as an array
    (`= ANY(ARRAY(...))`, in the same statement, so read in its snapshot): an IN of the subquery was
    planned as a loop over the windows, each testing the range's whole start index again, when the
    minute rows' statistics were not gathered yet (a partition just filled); the array is one index
    scan whatever the statistics say."""
    windows = unsummed.values("window_id")
    if connections[alias].vendor != "postgresql":
        return Q(window_id__in=windows)
    array = Func(Subquery(windows), template="ARRAY%(expressions)s", output_field=UUIDField())
    return Func(
        F("window_id"), array, arg_joiner=" = ANY(", template="%(expressions)s)", output_field=BooleanField()
    )


def added_up(
    parts,
    columns: list[str],
    *,
    most: int | None = None,
    by_connections: bool = False,
    after: list | None = None,
) -> Summed:
    """The rows of `parts` (`key_sums` of one or more querysets) added up by key: in key order (nulls
    last) after the key `after`, or with `by_connections` most connections first (then by key); at
    most `most` of them (None: all), with the count of every key. On PostgreSQL in one statement
    around the parts (the bound and the count in it: what is left out is never sent), on SQLite in
    Python."""
    if connections[parts.db].vendor == "postgresql":
        return _added_up_in_sql(parts, columns, most=most, by_connections=by_connections, after=after)
    rows = _merged(parts, columns)
    if after is not None:
        bound = null_last(after)
        rows = [row for row in rows if null_last(row[c] for c in columns) > bound]
    if by_connections:
        rows.sort(key=lambda row: -row["connection_count"])  # stable: ties stay in key order
    total = sum(row["connection_count"] for row in rows)
    return Summed(rows=rows if most is None else rows[:most], key_count=len(rows), connection_count=total)


class _StoredRows:
    """The rows of a `values()` queryset as the database stores them (`rows`), and each column's value
    as Django gives it (`value`), converted once per distinct stored value: a range's keys repeat their
    workloads (uuids) and instants (text on SQLite), and Django's per-row converters were most of the
    read."""

    def __init__(self, queryset) -> None:
        query = queryset.query
        self._compiler = compiler = query.get_compiler(queryset.db)
        self.names = list(query.selected) if query.selected else [
            *query.extra_select, *query.values_select, *query.annotation_select
        ]  # fmt: skip
        self._chunks = compiler.execute_sql(MULTI)
        fields = [s[0] for s in compiler.select[0 : compiler.col_count]]
        converters = compiler.get_converters(fields)
        self._converters = [converters.get(position) for position in range(len(self.names))]
        self._memos: list[dict] = [{} for _ in self.names]

    def rows(self) -> Iterator[tuple]:
        return itertools.chain.from_iterable(self._chunks)

    def value(self, position: int, stored):
        memo = self._memos[position]
        try:
            return memo[stored]
        except KeyError:
            pass
        value = stored
        found = self._converters[position]
        if found is not None:
            converters, expression = found
            for converter in converters:
                value = converter(value, expression, self._compiler.connection)
        memo[stored] = value
        return value


def _merged(parts, columns: list[str]) -> list[dict]:
    """Rows of the same key from several sums, added up, in the order SQL would give (nulls last).
    Grouped by the values stored, as SQL groups them (no rule: null in minute rows, NO_RULE in sums),
    and converted once a key."""
    read = _StoredRows(parts)
    at = {name: position for position, name in enumerate(read.names)}
    keys = [at[column] for column in columns]
    rule = at.get("rule_number")
    added = [at[name] for name in SUMMED]
    first, last = at["first_seen"], at["last_seen"]
    merged: dict[tuple, list] = {}
    for stored in read.rows():
        key = tuple([stored[k] for k in keys])
        if rule is not None:
            stored = list(stored)
            stored[rule] = rule_read(stored[rule])
            key = tuple([stored[k] for k in keys])
        seen = merged.get(key)
        if seen is None:
            merged[key] = list(stored)
            continue
        for position in added:
            seen[position] += stored[position]
        seen[first] = min(seen[first], stored[first], key=lambda v: read.value(first, v))
        seen[last] = max(seen[last], stored[last], key=lambda v: read.value(last, v))
    # Sorted by the values as Django gives them (a uuid by its integer, as UUID orders), each
    # column's order part worked out once per stored value.
    parts: list[dict] = [{} for _ in keys]

    def order(key: tuple) -> tuple:
        found = []
        for index, stored in enumerate(key):
            part = parts[index].get(stored)
            if part is None:
                value = read.value(keys[index], stored)
                part = parts[index][stored] = (
                    (True, 0) if value is None else (False, value.int if isinstance(value, UUID) else value)
                )
            found.append(part)
        return tuple(found)

    value, names = read.value, read.names
    return [
        {
            name: value(position, stored)
            for position, (name, stored) in enumerate(zip(names, merged[key], strict=True))
        }
        for key in sorted(merged, key=order)
    ]


def null_last(values) -> tuple:
    """The sort key of a group's key values: in column order, a null after every value."""
    return tuple((value is None, value if value is not None else 0) for value in values)


# How PostgreSQL orders a key column as `null_last` orders its values in Python: text by code point
# (the database's collation may order "1.2.3.4" after "12.0.0.1"), uuids bytewise as their integers.
_TEXT_COLUMNS = frozenset({"peer", "protocol", "decision"})
# Key columns of uuids: sent as their text and made UUIDs here, one object per distinct value (below).
_UUID_COLUMNS = frozenset({"workload_id", "peer_workload_id"})


def _added_up_in_sql(
    parts, columns: list[str], *, most: int | None, by_connections: bool, after: list | None
) -> Summed:
    """`_merged` in SQL: one row a key around the parts' UNION ALL, in the same order. A day of a
    thousand workloads is some 20,000 partial sums but 5,000 keys: turning each partial sum into a
    dict, its two timestamps parsed, was most of a rollup's time. The keys after `after` are chosen
    before they are added up and the bound is a LIMIT. The count of every key (and of their
    connections) is the rows' own when they are all read (a LIMIT of one more than the bound says so);
    past the bound the statement is run again with the count as a window over the grouped rows, before
    the LIMIT: the window materialises every grouped row and cost a fifth of a fleet's read, for a
    count that only a read past its bound needs."""
    rows = _added_up_statement(parts, columns, most=most, by_connections=by_connections, after=after)
    counted = most is not None and len(rows) > most
    if counted:
        # Past the bound: read again, counted in the same statement (its one snapshot: summing moves
        # windows between the parts, and a count from another statement could disagree with the rows).
        rows = _added_up_statement(
            parts, columns, most=most, by_connections=by_connections, after=after, counted=True
        )
    if not rows:
        return Summed(rows=[], key_count=0, connection_count=0)
    names = [*columns, *SUMMED, "first_seen", "last_seen"]  # the trailing counts left out by zip
    first_at, last_at = len(columns) + len(SUMMED), len(columns) + len(SUMMED) + 1
    uuid_at = [position for position, column in enumerate(columns) if column in _UUID_COLUMNS]
    # Each distinct instant made a datetime once, and each distinct uuid a UUID once: a range's keys
    # share their minutes' instants and their workloads, and one object per workload makes every
    # later look-up by it (dicts and sets of the classifier, the suggestions) find it by identity.
    instants: dict[int, datetime] = {}
    uuids: dict[str, UUID] = {}
    added_up = []
    for values in rows:
        row = dict(zip(names, values))  # noqa: B905 - the counts after the names are not the row's
        for position in uuid_at:
            text = values[position]
            if text is not None:
                found = uuids.get(text)
                if found is None:
                    found = uuids[text] = UUID(text)
                row[columns[position]] = found
        first, last = values[first_at], values[last_at]
        seen = instants.get(first)
        if seen is None:
            seen = instants[first] = _EPOCH + timedelta(microseconds=first)
        row["first_seen"] = seen
        seen = instants.get(last)
        if seen is None:
            seen = instants[last] = _EPOCH + timedelta(microseconds=last)
        row["last_seen"] = seen
        added_up.append(row)
    if counted:
        key_count, connection_count = rows[0][-2], rows[0][-1]
    else:
        key_count, connection_count = len(added_up), sum(row["connection_count"] for row in added_up)
    return Summed(rows=added_up, key_count=key_count, connection_count=connection_count)


def _added_up_statement(
    parts,
    columns: list[str],
    *,
    most: int | None,
    by_connections: bool,
    after: list | None,
    counted: bool = False,
) -> list[tuple]:
    """The statement of `_added_up_in_sql` run: its rows, up to `most` + 1 (one more than the bound
    says the read is past it), or with `counted` up to `most`, each ending in the count of every key
    and of their connections."""
    connection = connections[parts.db]
    sql, params = parts.query.get_compiler(connection=connection).as_sql()
    params = list(params)
    q = connection.ops.quote_name
    expressions = {c: f"NULLIF({q(c)}, {NO_RULE})" if c == "rule_number" else q(c) for c in columns}
    # A uuid is sent as its text (named apart, so that ORDER BY reads the uuid column itself): the
    # driver made a UUID object of every row's.
    keys = [
        f"{expressions[c]}::text AS {q(c + '_text')}" if c in _UUID_COLUMNS else expressions[c]
        for c in columns
    ]
    # sum() of bigint is numeric, exact past 2**63 (an older version took counts up to 2**62 a window):
    # loaded as an int (below), as Django's Sum makes its Decimal an int; text made ints in Python
    # cost a third of the rows' conversion.
    added = [f"sum({q(c)})" for c in SUMMED]
    # The instants as microseconds since the epoch: parsing 10,000 timestamps' text cost more than
    # the rest of the read in Python.
    added += [f"(extract(epoch FROM {f}({q(c)})) * 1000000)::bigint" for f, c in _SEEN]
    if counted:
        added += ["count(*) OVER ()", f"sum(sum({q('connection_count')})) OVER ()"]
    by = ", ".join(expressions[c] for c in columns)
    order = ", ".join(
        f'{q(c)} COLLATE "C" NULLS LAST'
        if c in _TEXT_COLUMNS
        else f"{q(c)} NULLS LAST"
        if c in _UUID_COLUMNS
        else f"{position} NULLS LAST"
        for position, c in enumerate(columns, start=1)
    )
    if by_connections:
        order = f"sum({q('connection_count')}) DESC, {order}"
    where = ""
    if after is not None:
        condition, condition_params = _after_in_sql(expressions, columns, after)
        where, params = f" WHERE {condition}", params + condition_params
    limit = ""
    if most is not None:
        limit, params = " LIMIT %s", [*params, most if counted else most + 1]
    select = ", ".join(keys + added)
    statement = f"SELECT {select} FROM ({sql}) AS parts{where} GROUP BY {by} ORDER BY {order}{limit}"  # noqa: S608 - our columns
    with connection.cursor() as cursor:
        # The sums (numeric) loaded by the driver as ints, in C: exact, and no Decimal or text made.
        from psycopg.types.numeric import IntLoader  # noqa: PLC0415 - PostgreSQL's driver only

        cursor.cursor.adapters.register_loader("numeric", IntLoader)
        cursor.execute(statement, params)
        return cursor.fetchall()


def _after_in_sql(expressions: dict[str, str], columns: list[str], last: list) -> tuple[str, list]:
    """Rows whose key comes after `last` in the key order (nulls last, text by code point), as
    flows.selectors `_after_key` says it for the ORM: (a > x or a is null) or (a = x and (b > y ...))."""
    alternatives, params = [], []
    for index, (column, value) in enumerate(zip(columns, last, strict=True)):
        if value is None:
            continue
        collate = ' COLLATE "C"' if column in _TEXT_COLUMNS else ""
        step = [f"({expressions[column]}{collate} > %s{collate} OR {expressions[column]} IS NULL)"]
        step_params = [value]
        for previous, earlier in zip(columns[:index], last[:index], strict=True):
            if earlier is None:
                step.append(f"{expressions[previous]} IS NULL")
            else:
                step.append(f"{expressions[previous]} = %s")
                step_params.append(earlier)
        alternatives.append("(" + " AND ".join(step) + ")")
        params += step_params
    return ("(" + " OR ".join(alternatives) + ")" if alternatives else "FALSE"), params


_SEEN = (("min", "first_seen"), ("max", "last_seen"))
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

"""On PostgreSQL, turn the three flow tables into tables partitioned by day (flows/partitions.py).

Rows already stored are kept: each table is renamed, a partitioned table of the same columns takes its
name, the day partitions its rows need are created, the rows are copied over, and the old table's
indexes and foreign keys are recreated on the new one. The group -> window foreign key is dropped
first (a partitioned table's unique key must include its partition key, so `id` alone cannot be
referenced); windows and their groups share a partition key and are dropped together. On SQLite
nothing changes.
"""

import django.db.models.deletion
from django.db import migrations, models

TABLES = {"flows_flowwindow": "start", "flows_flowgroup": "start", "flows_evidencegap": "end"}


def _partition_table(cursor, table: str, key: str) -> None:
    cursor.execute(
        "SELECT indexdef FROM pg_indexes WHERE tablename = %s AND indexname NOT IN "
        "(SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'p')",
        [table, table],
    )
    indexes = [row[0] for row in cursor.fetchall()]
    cursor.execute(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'f'",
        [table],
    )
    foreign_keys = cursor.fetchall()
    old = f"{table}_unpartitioned"
    cursor.execute(f'ALTER TABLE "{table}" RENAME TO "{old}"')
    cursor.execute(
        f'CREATE TABLE "{table}" (LIKE "{old}" INCLUDING DEFAULTS INCLUDING CONSTRAINTS) PARTITION BY RANGE ("{key}")'
    )
    cursor.execute(f'ALTER TABLE "{table}" ADD PRIMARY KEY ("id", "{key}")')
    cursor.execute(f'SELECT DISTINCT ("{key}" AT TIME ZONE \'UTC\')::date FROM "{old}"')  # noqa: S608 - our names
    for (day,) in cursor.fetchall():
        name = f"{table}_p{day:%Y%m%d}"
        cursor.execute(
            f'CREATE TABLE "{name}" PARTITION OF "{table}" '
            f"FOR VALUES FROM ('{day.isoformat()}T00:00:00+00:00') "
            f"TO ('{day.isoformat()}T00:00:00+00:00'::timestamptz + interval '1 day')"
        )
    cursor.execute(
        "SELECT attidentity <> '' FROM pg_attribute WHERE attrelid = %s::regclass AND attname = 'id'", [old]
    )
    if cursor.fetchone()[0]:
        # The identity column does not carry over to a partitioned table (PostgreSQL < 17): a sequence.
        sequence = f"{table}_id_partitioned_seq"
        cursor.execute(f'CREATE SEQUENCE "{sequence}" AS bigint')
        cursor.execute(
            f'SELECT setval(\'"{sequence}"\', COALESCE((SELECT max(id) FROM "{old}"), 0) + 1, false)'  # noqa: S608
        )
        cursor.execute(f'ALTER TABLE "{table}" ALTER COLUMN "id" SET DEFAULT nextval(\'"{sequence}"\')')
        cursor.execute(f'ALTER SEQUENCE "{sequence}" OWNED BY "{table}"."id"')
    cursor.execute(f'INSERT INTO "{table}" SELECT * FROM "{old}"')  # noqa: S608 - our names
    cursor.execute(f'DROP TABLE "{old}"')
    for definition in indexes:
        cursor.execute(definition)
    for name, definition in foreign_keys:
        cursor.execute(f'ALTER TABLE "{table}" ADD CONSTRAINT "{name}" {definition}')


def partition(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        for table, key in TABLES.items():
            _partition_table(cursor, table, key)


class Migration(migrations.Migration):
    dependencies = [("flows", "0001_flow_evidence")]

    operations = [
        migrations.AlterField(
            model_name="flowgroup",
            name="window",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="groups",
                to="flows.flowwindow",
            ),
        ),
        migrations.RunPython(partition, elidable=False),  # irreversible: the rows stay partitioned
    ]

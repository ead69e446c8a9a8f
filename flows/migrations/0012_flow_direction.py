"""Outbound evidence: every stored key carries its direction (who originated the connection) and the
fail-safe marker. The rows stored before are inbound, without the marker (the columns' defaults). The
sums' keys take both, so an inbound and an outbound key of the same peer and service are two rows.

On PostgreSQL the sums' keys are unique indexes of partitioned tables (migration 0002 recreated them as
indexes), not constraints: they are dropped and created again, over every partition, by name."""

from django.db import migrations, models

SPANS = (("flowhour", "hour"), ("flowquarter", "quarter"), ("flowblock", "block"))
OLD_KEY = ("workload", "{span}", "peer", "protocol", "port", "decision", "rule_number")
NEW_KEY = (*OLD_KEY, "direction", "failsafe")


def _constraint(span: str, fields: tuple[str, ...]) -> models.UniqueConstraint:
    return models.UniqueConstraint(fields=[f.format(span=span) for f in fields], name=f"flow_{span}_key")


def _columns(span: str, fields: tuple[str, ...]) -> str:
    return ", ".join(f'"{"workload_id" if f == "workload" else f.format(span=span)}"' for f in fields)


def keys_widen_in_postgresql(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        for model, span in SPANS:
            cursor.execute(f'DROP INDEX IF EXISTS "flow_{span}_key"')
            cursor.execute(
                f'CREATE UNIQUE INDEX "flow_{span}_key" ON "flows_{model}" ({_columns(span, NEW_KEY)})'
            )


class _RemoveConstraintElsewhere(migrations.RemoveConstraint):
    """The constraint a table of the other vendors holds (SQLite: in the table's definition)."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            super().database_forwards(app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            super().database_backwards(app_label, schema_editor, from_state, to_state)


class _AddConstraintElsewhere(migrations.AddConstraint):
    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            super().database_forwards(app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            super().database_backwards(app_label, schema_editor, from_state, to_state)


class Migration(migrations.Migration):
    dependencies = [
        ("flows", "0011_gap_kind_table_modified"),
    ]

    operations = [
        *[
            migrations.AddField(
                model_name=model,
                name="direction",
                field=models.CharField(
                    choices=[("inbound", "Inbound"), ("outbound", "Outbound")],
                    db_default="inbound",
                    default="inbound",
                    max_length=8,
                ),
            )
            for model in ("flowgroup", *(model for model, _ in SPANS))
        ],
        *[
            migrations.AddField(
                model_name=model,
                name="failsafe",
                field=models.BooleanField(db_default=False, default=False),
            )
            for model in ("flowgroup", *(model for model, _ in SPANS))
        ],
        *[
            operation
            for model, span in SPANS
            for operation in (
                _RemoveConstraintElsewhere(model_name=model, name=f"flow_{span}_key"),
                _AddConstraintElsewhere(model_name=model, constraint=_constraint(span, NEW_KEY)),
            )
        ],
        migrations.RunPython(keys_widen_in_postgresql, elidable=False),  # irreversible, as 0002's
    ]

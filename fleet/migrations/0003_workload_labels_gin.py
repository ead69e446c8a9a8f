"""On PostgreSQL, label filters use jsonb containment, which a GIN index answers without scanning."""

from django.db import migrations


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            "CREATE INDEX IF NOT EXISTS fleet_workload_labels_gin ON fleet_workload USING gin (labels jsonb_path_ops)"
        )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP INDEX IF EXISTS fleet_workload_labels_gin")


class Migration(migrations.Migration):
    dependencies = [("fleet", "0002_rendered_policy_lz4")]
    operations = [migrations.RunPython(create, drop)]

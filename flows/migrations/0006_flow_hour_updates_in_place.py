"""The hourly sums are updated in place by every report: drop their two indexes that nothing reads (the
key's unique index leads with the workload), and on PostgreSQL leave room on their pages for HOT
updates, in the day partitions that exist (new ones are created so, flows/partitions.py)."""

import django.db.models.deletion
from django.db import migrations, models


def leave_room_for_updates(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = 'flows_flowhour'::regclass"
        )
        for (partition,) in cursor.fetchall():
            cursor.execute(
                f"ALTER TABLE {partition} SET (fillfactor = 70)"
            )  # regclass text: quoted as needed


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0011_workload_flow_window_seconds_longest"),
        ("flows", "0005_flow_group_start_index"),
    ]

    operations = [
        migrations.AlterField(
            model_name="flowhour",
            name="peer_workload",
            field=models.ForeignKey(
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to="fleet.workload",
            ),
        ),
        migrations.AlterField(
            model_name="flowhour",
            name="workload",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="+",
                to="fleet.workload",
            ),
        ),
        migrations.RunPython(leave_room_for_updates, migrations.RunPython.noop, elidable=False),
    ]

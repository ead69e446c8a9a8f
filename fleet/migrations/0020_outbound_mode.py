"""The outbound mode: visibility for every existing workload (no output chain, so no stored document
changes); mode changes and their records say which mode they move (inbound for every existing one)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0019_workload_table_modified"),
    ]

    operations = [
        migrations.AddField(
            model_name="modechange",
            name="direction",
            field=models.CharField(default="inbound", max_length=8),
        ),
        migrations.AddField(
            model_name="modechangeworkload",
            name="direction",
            field=models.CharField(default="inbound", max_length=8),
        ),
        migrations.AddField(
            model_name="workload",
            name="outbound_mode",
            field=models.CharField(
                choices=[
                    ("visibility", "Visibility"),
                    ("simulation", "Simulation"),
                    ("enforced", "Enforced"),
                ],
                default="visibility",
                max_length=16,
            ),
        ),
        migrations.AddField(
            model_name="workload",
            name="outbound_mode_change",
            field=models.ForeignKey(
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to="fleet.modechange",
            ),
        ),
        migrations.AddField(
            model_name="workload",
            name="outbound_mode_since",
            field=models.DateTimeField(null=True),
        ),
    ]

"""Bounded keys: the `keys_aggregated` gap kind (a window's keys over the bound summed into its aggregate
keys), and each unsummed window's number of groups, by which summing sizes its transactions."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("flows", "0009_flow_quarters"),
    ]

    operations = [
        migrations.AddField(
            model_name="unsummedwindow",
            name="keys",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AlterField(
            model_name="evidencegap",
            name="kind",
            field=models.CharField(
                choices=[
                    ("source_overrun", "Source Overrun"),
                    ("source_restart", "Source Restart"),
                    ("buffer_overflow", "Buffer Overflow"),
                    ("dump_truncated", "Dump Truncated"),
                    ("window_overflow", "Window Overflow"),
                    ("window_rejected", "Window Rejected"),
                    ("table_removed", "Table Removed"),
                    ("agent_silent", "Agent Silent"),
                    ("keys_aggregated", "Keys Aggregated"),
                ],
                max_length=24,
            ),
        ),
    ]

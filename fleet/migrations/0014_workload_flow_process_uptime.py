from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0013_workload_flow_backlog_since"),
    ]

    operations = [
        migrations.AddField(
            model_name="workload",
            name="flow_process_uptime_seconds",
            field=models.FloatField(null=True),
        ),
        migrations.AddField(
            model_name="workload",
            name="flow_processes_before",
            field=models.TextField(blank=True, default=""),
            preserve_default=False,
        ),
    ]

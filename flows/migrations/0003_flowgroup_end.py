"""Each group carries its window's end, as it carries its start, so that rollups read one table."""

from django.db import migrations, models

BACKFILL = """
UPDATE flows_flowgroup SET "end" = (
    SELECT w."end" FROM flows_flowwindow w WHERE w.id = flows_flowgroup.window_id AND w.start = flows_flowgroup.start
)
"""


class Migration(migrations.Migration):
    dependencies = [("flows", "0002_partition_by_day")]

    operations = [
        migrations.AddField(model_name="flowgroup", name="end", field=models.DateTimeField(null=True)),
        migrations.RunSQL(BACKFILL, migrations.RunSQL.noop),
        migrations.AlterField(model_name="flowgroup", name="end", field=models.DateTimeField()),
    ]

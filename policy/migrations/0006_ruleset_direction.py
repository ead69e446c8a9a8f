"""A ruleset's direction: every existing ruleset stays inbound, and renders byte for byte as before."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("policy", "0005_rule_action"),
    ]

    operations = [
        migrations.AddField(
            model_name="ruleset",
            name="direction",
            field=models.CharField(
                choices=[("inbound", "Inbound"), ("outbound", "Outbound")], default="inbound", max_length=8
            ),
        ),
    ]

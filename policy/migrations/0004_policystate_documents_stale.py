"""Address groups are known to the renderer by name, not id (so an exported policy renders the same
on another control plane): every stored document naming a group's set is stale. serve re-renders
every workload once before it listens (fleet.rendering.documents_refresh_if_stale)."""

from django.db import migrations, models


def mark_documents_stale(apps, schema_editor):
    apps.get_model("policy", "PolicyState").objects.update(documents_stale=True)


class Migration(migrations.Migration):
    dependencies = [("policy", "0003_rule_lifetime_number")]

    operations = [
        migrations.AddField(
            model_name="policystate", name="documents_stale", field=models.BooleanField(default=False)
        ),
        migrations.RunPython(mark_documents_stale, migrations.RunPython.noop),
    ]

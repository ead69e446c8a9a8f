from django.db import migrations
from django.utils import timezone


def create(apps, schema_editor):
    # The row fleet-wide events' writers lock (controlplane/webhooks/outbox.py FLEET_ORDER).
    apps.get_model("webhooks", "WebhookWatermark").objects.get_or_create(
        name="fleet-events", defaults={"at": timezone.now()}
    )


class Migration(migrations.Migration):
    dependencies = [("webhooks", "0001_initial")]

    operations = [migrations.RunPython(create, migrations.RunPython.noop)]

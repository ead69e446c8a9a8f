from django.db import migrations, models


def addresses_from_address(apps, schema_editor):
    GatewayIdentity = apps.get_model("controlplane", "GatewayIdentity")
    for row in GatewayIdentity.objects.all():
        row.addresses = [row.address]
        row.save(update_fields=["addresses"])


class Migration(migrations.Migration):
    dependencies = [("controlplane", "0003_gateway_identity_flow_retention")]

    operations = [
        migrations.AddField(
            model_name="gatewayidentity", name="addresses", field=models.JSONField(default=list)
        ),
        migrations.RunPython(addresses_from_address, migrations.RunPython.noop),
    ]

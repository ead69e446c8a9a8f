import re

from django.db import migrations, models

# Attempts used to store a receiver's own text (the start of its answer's body, a banner read as a
# status line, a redirect's Location). The sender now records a status code and a reason of its own;
# what was stored is cut down the same way.
_CLASS_NAME = re.compile(r"[A-Za-z]+")


def reason_of(status_code, error):
    if status_code is not None:
        return "redirect not followed" if 300 <= status_code < 400 else f"HTTP {status_code}"
    if error.startswith("no answer within"):
        return error
    name = error.split(":", 1)[0].strip()
    return name if _CLASS_NAME.fullmatch(name) else "no HTTP answer"


def scrub(apps, schema_editor):
    attempts = apps.get_model("webhooks", "WebhookAttempt").objects
    by_reason: dict[str, list[int]] = {}
    for id, status_code, error in attempts.exclude(error="").values_list("id", "status_code", "error"):
        reason = reason_of(status_code, error)
        if reason != error:
            by_reason.setdefault(reason, []).append(id)
    for reason, ids in by_reason.items():
        for start in range(0, len(ids), 500):
            attempts.filter(id__in=ids[start : start + 500]).update(error=reason)


class Migration(migrations.Migration):
    dependencies = [("webhooks", "0002_fleet_order_row")]

    operations = [
        migrations.AddField(
            model_name="webhookdelivery",
            name="coalesced_count",
            field=models.PositiveIntegerField(default=1),
        ),
        migrations.AddField(
            model_name="webhookdelivery",
            name="coalesced_since",
            field=models.DateTimeField(null=True),
        ),
        migrations.AlterField(
            model_name="webhookdelivery",
            name="state",
            field=models.CharField(
                choices=[
                    ("pending", "pending"),
                    ("delivered", "delivered"),
                    ("gave_up", "gave_up"),
                    ("superseded", "superseded"),
                ],
                default="pending",
                max_length=16,
            ),
        ),
        migrations.RunPython(scrub, migrations.RunPython.noop),
    ]

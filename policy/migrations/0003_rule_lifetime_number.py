"""Rules get a lifetime number (the ct mark's rule bits), never reused: existing rules are numbered in
the order they were created, and the policy state's counter starts after them."""

from django.db import migrations, models


def number_existing_rules(apps, schema_editor):
    Rule = apps.get_model("policy", "Rule")
    PolicyState = apps.get_model("policy", "PolicyState")
    number = 0
    for rule in Rule.objects.order_by("created_at", "id").only("id"):
        number += 1
        Rule.objects.filter(id=rule.id).update(number=number)
    state, _ = PolicyState.objects.get_or_create(id=1)
    state.next_rule_number = number + 1
    state.save(update_fields=["next_rule_number"])


class Migration(migrations.Migration):
    dependencies = [("policy", "0002_vocabulary_choices")]

    operations = [
        migrations.AddField(
            model_name="policystate",
            name="next_rule_number",
            field=models.PositiveIntegerField(default=1),
        ),
        migrations.AddField(model_name="rule", name="number", field=models.PositiveIntegerField(null=True)),
        migrations.RunPython(number_existing_rules, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="rule", name="number", field=models.PositiveIntegerField(unique=True)
        ),
    ]

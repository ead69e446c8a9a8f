"""A rule's action: every existing rule keeps its meaning (allow); deny rules refuse above every allow.
Documents without deny rules render byte for byte as before, so no stored document is stale."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("policy", "0004_policystate_documents_stale")]

    operations = [
        migrations.AddField(
            model_name="rule",
            name="action",
            field=models.CharField(
                choices=[("allow", "Allow"), ("deny", "Deny")], default="allow", max_length=8
            ),
        ),
    ]

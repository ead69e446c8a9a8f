"""Documents with an output chain (a workload's outbound mode simulation or enforced) write an inbound
scope whose workloads' addresses collapse into at most half as many prefixes as those prefixes (a set
of its own, `dst_...`), and their version is the digest of their parts' digests. Those stored documents
are stale; serve re-renders every workload once before it listens. Documents without an output chain
render byte for byte as before, with the same version: a fleet that never judged outbound is left as
it is."""

from django.db import migrations


def mark_documents_stale(apps, schema_editor):
    if apps.get_model("fleet", "Workload").objects.exclude(outbound_mode="visibility").exists():
        apps.get_model("policy", "PolicyState").objects.update(documents_stale=True)


class Migration(migrations.Migration):
    dependencies = [
        ("policy", "0006_ruleset_direction"),
        ("fleet", "0020_outbound_mode"),
    ]

    operations = [migrations.RunPython(mark_documents_stale, migrations.RunPython.noop)]

"""Sums over quarter days (six hours from midnight UTC), what rollups read for the whole quarters of a
range, written with the hourly and ten-minute sums; partitioned by day on PostgreSQL like the other flow
tables (flows/partitions.py), with room on their pages for updates in place. The windows already
summed get their quarters here, so that every summed window is in each of the sums."""

import importlib

import django.db.models.deletion
from django.db import migrations, models

# Per vendor: the quarter of a start, and one of the peer workloads (PostgreSQL has no max() of a uuid).
QUARTER_OF = {
    "postgresql": (
        "date_bin('6 hours', start, TIMESTAMPTZ '2000-01-01 00:00:00+00')",
        "(array_agg(peer_workload_id))[1]",
    ),
    "sqlite": (
        "strftime('%Y-%m-%d ', start) || printf('%02d', CAST(strftime('%H', start) AS INTEGER) / 6 * 6)"
        " || ':00:00'",
        "max(peer_workload_id)",
    ),
}
# Migration 0004 partitions and fills the hourly sums the same way.
HOURS = importlib.import_module("flows.migrations.0004_flow_hours")


def partition(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        HOURS.partition_sums(cursor, "flows_flowquarter", "quarter")
        cursor.execute(
            "SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = 'flows_flowquarter'::regclass"
        )
        for (name,) in cursor.fetchall():
            cursor.execute(f"ALTER TABLE {name} SET (fillfactor = 70)")  # regclass text: quoted as needed


def backfill(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    with schema_editor.connection.cursor() as cursor:
        quarter, peer_workload = QUARTER_OF.get(vendor, QUARTER_OF["postgresql"])
        cursor.execute(
            HOURS.BACKFILL.format(
                table="flows_flowquarter",
                column="quarter",
                bucket=quarter,
                peer_workload=peer_workload,
                where="WHERE window_id NOT IN (SELECT window_id FROM flows_unsummedwindow)",
            )
        )


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0012_workload_flow_window_seconds"),
        ("flows", "0008_flow_blocks"),
    ]

    operations = [
        migrations.CreateModel(
            name="FlowQuarter",
            fields=[
                ("peer", models.CharField(max_length=45)),
                ("protocol", models.CharField(max_length=8)),
                ("port", models.PositiveIntegerField()),
                (
                    "decision",
                    models.CharField(
                        choices=[
                            ("observed", "Observed"),
                            ("allowed", "Allowed"),
                            ("would_block", "Would Block"),
                            ("blocked", "Blocked"),
                        ],
                        max_length=16,
                    ),
                ),
                ("connection_count", models.PositiveBigIntegerField()),
                ("first_seen", models.DateTimeField()),
                ("last_seen", models.DateTimeField()),
                ("bytes_in", models.PositiveBigIntegerField()),
                ("bytes_out", models.PositiveBigIntegerField()),
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("quarter", models.DateTimeField()),
                ("rule_number", models.PositiveIntegerField()),
                (
                    "peer_workload",
                    models.ForeignKey(
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to="fleet.workload",
                    ),
                ),
                (
                    "workload",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="fleet.workload",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("workload", "quarter", "peer", "protocol", "port", "decision", "rule_number"),
                        name="flow_quarter_key",
                    )
                ],
                "indexes": [models.Index(fields=["quarter"], name="flow_quarter_start")],
            },
        ),
        migrations.RunPython(partition, elidable=False),  # irreversible: the rows stay partitioned
        migrations.RunPython(backfill, elidable=False),
    ]

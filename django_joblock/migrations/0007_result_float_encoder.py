"""The results' and payloads' encoder writes big floats in full (``ResultEncoder``: PostgreSQL's
``jsonb`` gave ``1e+20`` back as an int). An encoder is not in the schema: the state changes,
the tables do not (an ``AlterField`` would rebuild both tables on SQLite for nothing)."""

from django.db import migrations, models

import django_joblock.models


class Migration(migrations.Migration):
    dependencies = [
        ("django_joblock", "0006_outbox_dead"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="idempotencyrecord",
                    name="result",
                    field=models.JSONField(
                        blank=True, encoder=django_joblock.models.ResultEncoder, null=True
                    ),
                ),
                migrations.AlterField(
                    model_name="outboxmessage",
                    name="payload",
                    field=models.JSONField(encoder=django_joblock.models.ResultEncoder),
                ),
            ],
        ),
    ]

from django.db import migrations, models


class Migration(migrations.Migration):
    """``IdempotencyRecord.owner`` is ``token``: it holds the claim's secret (every other
    ``owner`` is the short hash shown to people)."""

    dependencies = [("django_joblock", "0004_outbox")]

    operations = [
        migrations.RenameField(model_name="idempotencyrecord", old_name="owner", new_name="token"),
        migrations.AlterField(
            model_name="idempotencyrecord",
            name="token",
            field=models.CharField(
                blank=True,
                default="",
                help_text="Secret of the claim that holds (or held) the lease (never shown).",
                max_length=64,
            ),
        ),
    ]

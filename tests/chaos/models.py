"""The chaos workload's tables: a balance per resource, and one ledger row per applied effect."""

from __future__ import annotations

from django.db import models

from django_joblock.models import FencedModel


class Balance(FencedModel):
    name = models.CharField(max_length=50, unique=True)
    value = models.BigIntegerField(default=0)

    class Meta:
        app_label = "chaos"


class Effect(models.Model):
    """Written in the same transaction as the balance change: one row per *application*, so
    an effect applied twice shows up as two rows of one logical job."""

    logical_id = models.CharField(max_length=50, db_index=True)
    resource = models.CharField(max_length=50)
    delta = models.IntegerField()
    fence = models.BigIntegerField(null=True)

    class Meta:
        app_label = "chaos"

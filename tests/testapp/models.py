from __future__ import annotations

from django.db import models

from django_joblock.models import FencedModel


class Account(FencedModel):
    """A row written under a lock: the fencing tests' target."""

    name = models.CharField(max_length=50, unique=True)
    balance = models.IntegerField(default=0)

    class Meta:
        app_label = "testapp"


class Owner(models.Model):
    """The relation a :class:`Ledger` queryset filters across (a join in its ``UPDATE``)."""

    name = models.CharField(max_length=50)

    class Meta:
        app_label = "testapp"


class Ledger(FencedModel):
    """A fenced row with a foreign key: fenced_update() on querysets that join."""

    balance = models.IntegerField(default=0)
    owner = models.ForeignKey(Owner, on_delete=models.CASCADE)

    class Meta:
        app_label = "testapp"


class FencedParent(FencedModel):
    """Multi-table inheritance: ``lock_fence`` lives on this (the parent's) table..."""

    name = models.CharField(max_length=50, default="")

    class Meta:
        app_label = "testapp"


class FencedChild(FencedParent):
    """...and ``balance`` on the child's: one ``UPDATE`` cannot fence both."""

    balance = models.IntegerField(default=0)

    class Meta:
        app_label = "testapp"

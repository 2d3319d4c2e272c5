from __future__ import annotations

from django.db import models

from django_joblock.models import FencedModel


class Account(FencedModel):
    """A row written under a lock: the fencing tests' target."""

    name = models.CharField(max_length=50, unique=True)
    balance = models.IntegerField(default=0)

    class Meta:
        app_label = "testapp"

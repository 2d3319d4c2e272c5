"""``FencedModel`` alone, so that a project may keep it after taking ``django_joblock`` out of
``INSTALLED_APPS`` (docs/upgrading.md): an abstract model needs no installed app, while
importing :mod:`django_joblock.models` would then fail on its concrete models."""

from __future__ import annotations

from django.db import models


class FencedModel(models.Model):
    """Abstract model with the ``lock_fence`` column that :func:`fenced_update` compares."""

    lock_fence = models.BigIntegerField(
        null=True,
        blank=True,
        editable=False,
        help_text="Fence of the last lock holder that wrote this row.",
    )

    class Meta:
        abstract = True

"""Models of django-joblock.

``FencedModel`` is abstract: subclass it to give a table the ``lock_fence`` column that
:func:`django_joblock.fenced_update` compares.
"""

from __future__ import annotations

from django.db import models


class FencedModel(models.Model):
    """Abstract model with the ``lock_fence`` column that :func:`fenced_update` compares."""

    lock_fence = models.BigIntegerField(
        null=True, blank=True, editable=False,
        help_text="Fence of the last lock holder that wrote this row.",
    )

    class Meta:
        abstract = True

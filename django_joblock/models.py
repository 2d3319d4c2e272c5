"""Models of django-joblock.

``FencedModel`` is abstract: subclass it to give a table the ``lock_fence`` column that
:func:`django_joblock.fenced_update` compares.
"""

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


class IdempotencyRecord(models.Model):
    """What was already done: one row per (scope, key), claimed race-free.

    ``status`` is ``running`` while a claim holds the lease, ``succeeded`` once
    ``claim.succeed()`` committed with the business write (its ``result`` is replayed to later
    claims), or ``failed`` (retryable: the next claim runs again). ``expires_at`` is when
    ``manage.py joblock_purge`` may delete the row.
    """

    class Status(models.TextChoices):
        RUNNING = "running", "running"
        SUCCEEDED = "succeeded", "succeeded"
        FAILED = "failed", "failed"

    scope = models.CharField(max_length=100, blank=True, default="")
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(
        max_length=64,
        blank=True,
        default="",
        help_text="sha256 of the canonical arguments; the same key with other arguments is "
        "refused.",
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.RUNNING)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    owner = models.CharField(
        max_length=64,
        blank=True,
        default="",
        help_text="Token of the claim that holds (or held) the lease.",
    )
    fence = models.BigIntegerField(
        null=True, blank=True, help_text="Fence of the lock held when claimed, if any."
    )
    lock_resource = models.CharField(
        max_length=200, blank=True, default="", help_text="Resource of that lock."
    )
    rq_job_id = models.CharField(max_length=128, blank=True, default="")
    attempts = models.PositiveIntegerField(default=1)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        verbose_name = "idempotency record"
        constraints = [
            models.UniqueConstraint(fields=["scope", "key"], name="joblock_idem_scope_key"),
        ]
        indexes = [
            models.Index(fields=["status", "lease_expires_at"], name="joblock_idem_status_lease")
        ]

    def __str__(self) -> str:
        return f"{self.scope}:{self.key}" if self.scope else self.key

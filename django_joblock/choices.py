"""The values of the models' choice fields, importable before Django's app registry is ready:
the models' ``choices`` (``IdempotencyRecord.Status`` is :class:`RecordStatus`...), and what
the library compares records against instead of string literals."""

from __future__ import annotations

from django.db import models


class RecordStatus(models.TextChoices):
    """``IdempotencyRecord.status``."""

    RUNNING = "running", "running"  # a claim holds the lease
    SUCCEEDED = "succeeded", "succeeded"  # committed with the effect; its result replays
    FAILED = "failed", "failed"  # retryable: the next claim runs again


class AuditAction(models.TextChoices):
    """``LockAudit.action``: what an operator did to a lock."""

    FORCE_RELEASE = "force_release", "force release"
    REAP = "reap", "reap (holder dead)"


class OutboxStatus(models.TextChoices):
    """``OutboxMessage.status``."""

    PENDING = "pending", "pending"  # committed, not acknowledged by its handler yet
    DELIVERED = "delivered", "delivered"  # the handler returned: the provider has it
    DEAD = "dead", "dead"  # dead-lettered: outbox.MAX_ATTEMPTS deliveries failed; not retried

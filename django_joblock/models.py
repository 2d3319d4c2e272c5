"""Models of django-joblock."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models

from .choices import AuditAction, OutboxStatus, RecordStatus
from .fenced import FencedModel as FencedModel  # its home before; kept for imports of it

# In JSON text: a string (skipped whole), or a float Python writes with a positive exponent.
_STRING_OR_BIG_FLOAT = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?e\+\d+')


class ResultEncoder(DjangoJSONEncoder):
    """Django's encoder (``Decimal``, ``datetime``, ``UUID``... as strings) for the stored
    results and payloads, writing a float of 1e16 or more in full with a fraction (``1e+20`` as
    ``100000000000000000000.0``), so that it reads back as the same float on every backend.

    PostgreSQL's ``jsonb`` keeps a number as ``numeric`` and gives it back without an exponent:
    ``1e+20`` came back as the int ``100000000000000000000``, and ``1.5e+300`` as an int not
    equal to the float (SQLite keeps the text, and gave back the float). Written with a
    fraction, ``jsonb`` keeps the ``.0`` and JSON reads a float. Every such float is a whole
    number (its shortest form has at most 17 digits), so nothing else changes."""

    def iterencode(self, o: Any, _one_shot: bool = False) -> Any:
        """The chunks of Django's encoder, big floats written in full (a chunk of the standard
        encoder never splits a string or a number)."""
        for chunk in super().iterencode(o, _one_shot):
            yield _STRING_OR_BIG_FLOAT.sub(_in_full, chunk) if "e+" in chunk else chunk


def _in_full(match: re.Match[str]) -> str:
    token = match.group()
    if token.startswith('"'):
        return token
    return f"{Decimal(token):f}.0"


class IdempotencyRecord(models.Model):
    """One row per (scope, key), claimed race-free (:mod:`django_joblock.idempotency.claims`);
    ``joblock_purge`` may delete it after ``expires_at``."""

    Status = RecordStatus

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
    # Django's encoder, which claims check results with: Decimal, datetime, UUID... replay as
    # strings; a big float replays as a float on PostgreSQL too (ResultEncoder).
    result = models.JSONField(null=True, blank=True, encoder=ResultEncoder)
    error = models.TextField(blank=True, default="")
    token = models.CharField(
        max_length=64,
        blank=True,
        default="",
        help_text="Secret of the claim that holds (or held) the lease (never shown).",
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
            models.UniqueConstraint(fields=["scope", "key"], name="joblock_idem_scope_key")
        ]
        indexes = [
            models.Index(fields=["status", "lease_expires_at"], name="joblock_idem_status_lease")
        ]

    def __str__(self) -> str:
        return f"{self.scope}:{self.key}" if self.scope else self.key


class Dashboard(models.Model):
    """No table: the admin entry "Job locks" and its permission ``force_release_lock``."""

    class Meta:
        managed = False
        verbose_name = "job locks"
        verbose_name_plural = "job locks"
        default_permissions = ()
        permissions = [("force_release_lock", "Can force-release a lock held by a job")]


class LockAudit(models.Model):
    """Append-only record of every operator action on a lock (force release, reap)."""

    Action = AuditAction

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    action = models.CharField(max_length=32, choices=Action.choices)
    resource = models.CharField(max_length=200, db_index=True)
    owner = models.CharField(max_length=16, help_text="Hash of the released owner's token.")
    fence = models.BigIntegerField(null=True, blank=True)
    holder = models.JSONField(default=dict, help_text="Holder details at release time.")
    reason = models.TextField()
    released = models.BooleanField(help_text="False when refused (owner changed, gone).")
    outcome = models.CharField(max_length=200)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor = models.CharField(max_length=150, help_text="User name, or the command that acted.")

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "lock audit entry"
        verbose_name_plural = "lock audit log"

    def __str__(self) -> str:
        return f"{self.action} {self.resource} by {self.actor}"

    def save(self, *args: object, **kwargs: object) -> None:
        if self.pk is not None:
            raise ValueError("LockAudit rows are append-only.")
        super().save(*args, **kwargs)

    def delete(self, *args: object, **kwargs: object) -> tuple[int, dict[str, int]]:
        raise ValueError("LockAudit rows are append-only.")


class OutboxMessage(models.Model):
    """A side effect outside the database, recorded in the job's transaction and delivered
    after its commit (:mod:`django_joblock.outbox`). ``key`` is unique: one intent, one row."""

    Status = OutboxStatus

    key = models.CharField(max_length=255, unique=True)
    handler = models.CharField(max_length=255, help_text="Dotted path of the delivery function.")
    payload = models.JSONField(encoder=ResultEncoder)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")
    rq_job_id = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    next_attempt_at = models.DateTimeField()
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-pk"]
        verbose_name = "outbox message"
        permissions = [("deliver_outbox_message", "Can deliver an outbox message now")]
        indexes = [models.Index(fields=["status", "next_attempt_at"], name="joblock_outbox_due")]

    def __str__(self) -> str:
        return f"{self.handler} {self.key} ({self.status})"

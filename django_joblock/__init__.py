"""django-joblock: correct RQ queues under retries, duplicate delivery, long jobs, dead workers.

The public API. Everything else is an implementation detail and may change.
"""

from __future__ import annotations

import importlib

from .exceptions import (
    IdempotencyClaimLost,
    IdempotencyError,
    IdempotencyInProgress,
    IdempotencyKeyMismatch,
    InvalidResource,
    JoblockConfigError,
    JoblockError,
    LockBackendUnavailable,
    LockContentionTimeout,
    LockError,
    LockLost,
    LockNotAcquired,
    ResourceInTransaction,
    StaleFence,
)
from .idempotency.claims import Claim, fingerprint_of, idempotent
from .jobs.decorator import locked_job
from .jobs.outcomes import JobOutcome
from .jobs.spec import OnConflict
from .locks.async_lock import AsyncLock, alock
from .locks.fencing import afenced_update, fenced_update
from .locks.info import LockInfo, lock_holders, lock_info
from .locks.lock import Lock, LockState, current_lock, lock
from .outbox import send_after_commit

__all__ = [
    "AsyncLock",
    "Claim",
    "FencedModel",
    "IdempotencyClaimLost",
    "IdempotencyError",
    "IdempotencyInProgress",
    "IdempotencyKeyMismatch",
    "IdempotencyRecord",
    "InvalidResource",
    "JobOutcome",
    "JoblockConfigError",
    "JoblockError",
    "Lock",
    "LockBackendUnavailable",
    "LockContentionTimeout",
    "LockError",
    "LockInfo",
    "LockLost",
    "LockNotAcquired",
    "LockState",
    "OnConflict",
    "OutboxMessage",
    "ResourceInTransaction",
    "StaleFence",
    "afenced_update",
    "alock",
    "current_lock",
    "fenced_update",
    "fingerprint_of",
    "force_release",
    "idempotent",
    "lock",
    "lock_holders",
    "lock_info",
    "locked_job",
    "locked_task",
    "send_after_commit",
]


def __getattr__(name: str) -> object:
    # Models import only once the app registry is ready: lazily, so that settings files can
    # ``import django_joblock``. FencedModel comes from its own module (app uninstalled);
    # locked_task needs Django >= 6 or the django-tasks backport; force_release writes the
    # audit log (a model).
    module = {
        "FencedModel": "fenced",
        "IdempotencyRecord": "models",
        "force_release": "monitor.control",
        "OutboxMessage": "models",
        "locked_task": "jobs.task",
    }
    if name in module:
        return getattr(importlib.import_module(f".{module[name]}", __name__), name)
    raise AttributeError(f"module 'django_joblock' has no attribute {name!r}")

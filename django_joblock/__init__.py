"""django-joblock: correct RQ queues under retries, duplicate delivery, long jobs, dead workers.

The public API. Everything else is an implementation detail and may change.
"""

from __future__ import annotations

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
from .locks.fencing import fenced_update
from .locks.info import LockInfo, lock_info
from .locks.lock import Lock, LockState, current_lock, lock
from .outbox import send_after_commit

__all__ = [
    "Claim",
    "FencedModel",
    "IdempotencyClaimLost",
    "IdempotencyError",
    "IdempotencyInProgress",
    "IdempotencyKeyMismatch",
    "IdempotencyRecord",
    "InvalidResource",
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
    "OutboxMessage",
    "ResourceInTransaction",
    "StaleFence",
    "current_lock",
    "fenced_update",
    "fingerprint_of",
    "idempotent",
    "lock",
    "lock_info",
    "locked_job",
    "send_after_commit",
]


def __getattr__(name: str) -> object:
    # Model classes can only be imported once the app registry is ready; resolve them lazily
    # so that ``import django_joblock`` works in settings files.
    if name == "FencedModel":  # without the models: usable with the app uninstalled
        from .fenced import FencedModel

        return FencedModel
    if name in ("IdempotencyRecord", "OutboxMessage"):
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module 'django_joblock' has no attribute {name!r}")

"""django-joblock: correct RQ queues under retries, duplicate delivery, long jobs, dead workers.

The public API. Everything else is an implementation detail and may change.
"""

from __future__ import annotations

from .exceptions import (
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
    StaleFence,
)
from .fencing import fenced_update
from .locks import Lock, LockState, current_lock, lock

__all__ = [
    "FencedModel",
    "IdempotencyError",
    "IdempotencyInProgress",
    "IdempotencyKeyMismatch",
    "InvalidResource",
    "JoblockConfigError",
    "JoblockError",
    "Lock",
    "LockBackendUnavailable",
    "LockContentionTimeout",
    "LockError",
    "LockLost",
    "LockNotAcquired",
    "LockState",
    "StaleFence",
    "current_lock",
    "fenced_update",
    "lock",
]


def __getattr__(name: str) -> object:
    # Model classes can only be imported once the app registry is ready; resolve them lazily
    # so that ``import django_joblock`` works in settings files.
    if name == "FencedModel":
        from .models import FencedModel

        return FencedModel
    raise AttributeError(f"module 'django_joblock' has no attribute {name!r}")

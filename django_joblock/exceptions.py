"""The one exception tree of django-joblock. Lock errors carry what an operator needs to find
the lock again: resource, Redis key and owner (a short hash of the token; never the token,
which would let a log reader release somebody else's lock)."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured


class JoblockError(Exception):
    """Base class of every error raised by django-joblock."""


class JoblockConfigError(JoblockError, ImproperlyConfigured):
    """The ``JOBLOCK`` setting (or an argument standing in for one) is invalid."""


class InvalidResource(JoblockError, ValueError):
    """A resource string is empty, too long or uses characters outside ``[A-Za-z0-9_.:@/-]``."""


class LockError(JoblockError):
    """Base class of lock errors; carries ``resource``, ``key`` and ``owner`` (token hash)."""

    def __init__(
        self,
        message: str,
        *,
        resource: str | None = None,
        key: str | None = None,
        owner: str | None = None,
    ) -> None:
        self.resource = resource
        self.key = key
        self.owner = owner
        found = {"resource": resource, "key": key, "owner": owner}
        context = ", ".join(f"{n}={v!r}" for n, v in found.items() if v is not None)
        super().__init__(f"{message} ({context})" if context else message)


class LockNotAcquired(LockError):
    """Another owner holds the lock and it did not come free within the allowed wait."""


class ResourceInTransaction(LockNotAcquired):
    """The lock is this run's, but the resource's previous holder is still inside its database
    transaction (PostgreSQL; it lost its lock, or ran inline in an enclosing transaction):
    nothing ran, ``on_conflict`` applies."""


class LockContentionTimeout(LockNotAcquired):
    """A job gave up after waiting ``REQUEUE_MAX_WAIT`` seconds in total for a busy lock."""


class LockLost(LockError):
    """The lock expired, was taken by another owner, or could not be renewed in time."""


class LockBackendUnavailable(LockError):
    """Redis could not be asked (down, timed out, out of memory): never reported as "busy"."""


class StaleFence(LockError):
    """A fenced write was refused because a newer lock holder has already written the rows."""

    def __init__(
        self, message: str, *, fence: int, current: int | None = None, resource: str | None = None
    ) -> None:
        self.fence = fence
        self.current = current
        super().__init__(message, resource=resource)


class IdempotencyError(JoblockError):
    """Base class of idempotency-record errors; carries ``key`` and ``scope``."""

    def __init__(self, message: str, *, key: str | None = None, scope: str | None = None) -> None:
        self.key = key
        self.scope = scope
        super().__init__(message)


class IdempotencyKeyMismatch(IdempotencyError):
    """The same idempotency key was reused with different arguments (another fingerprint)."""


class IdempotencyInProgress(IdempotencyError):
    """Another owner holds a live lease on this idempotency key."""


class IdempotencyClaimLost(IdempotencyError):
    """This claim's lease was taken over by another claim; its success was not recorded."""

"""Structured log records on the ``django_joblock`` logger.

Every lock event (acquired, contended, renewed, renew_failed, released, lost) is logged by
:func:`log_lock` with the same ``extra`` fields, so that a log pipeline can follow one lock:
``job_id``, ``resource``, ``lock_key``, ``lock_owner`` (a short hash of the token, never the token),
``lock_ttl`` (seconds), ``fence``, ``outcome`` and ``reason``. A job run's one line
(:mod:`django_joblock.jobs.outcomes`) has its own: ``job_id``, ``resource``, ``idempotency_key``,
``outcome``, ``reason``, ``holder`` and ``waited``; a lock dropped while held, ``resource``,
``lock_key`` and ``outcome="dropped"``."""

from __future__ import annotations

import logging
from typing import Protocol

logger = logging.getLogger("django_joblock")


class Logged(Protocol):
    """What a lock event's log line says of the lock."""

    job_id: str
    resource: str
    key: str
    ttl: float
    fence: int | None

    @property
    def owner(self) -> str: ...


def log_lock(level: int, outcome: str, lock: Logged, message: str, reason: str = "") -> None:
    """Log one lock event with the structured ``extra`` fields."""
    if not logger.isEnabledFor(level):
        return
    extra: dict[str, object] = {
        "job_id": lock.job_id or None,
        "resource": lock.resource,
        "lock_key": lock.key,
        "lock_owner": lock.owner,
        "lock_ttl": lock.ttl,
        "fence": lock.fence,
        "outcome": outcome,
        "reason": reason,
    }
    line = "%s: %s (resource=%s owner=%s fence=%s)"
    logger.log(level, line, outcome, message, lock.resource, lock.owner, lock.fence, extra=extra)

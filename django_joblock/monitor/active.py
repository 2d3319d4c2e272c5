"""The active locks, and the queues of the ``@locked_job`` functions, as pages, commands and
alerts show them. Locks are read from the active-lock index (:mod:`~django_joblock.locks.index`)
and the lock hashes; an entry whose hash is gone or another owner's is dropped from the index
here. No ``KEYS``, no ``SCAN``: the cost is bounded by what is shown."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from rq.scheduler import RQScheduler

from ..backend import client
from ..exceptions import JoblockConfigError
from ..jobs.decorator import registered_jobs
from ..jobs.queues import get_queue, queue_name
from ..jobs.spec import OnConflict
from ..locks import index
from ..locks.info import Holder, read_many

logger = logging.getLogger("django_joblock")


@dataclass(frozen=True)
class ActiveLock(Holder):
    """One held lock, its holder and how long it was held."""

    resource: str
    family: str
    owner: str
    pttl_ms: int
    held_for: float  # seconds, on the lock server's clock
    read_ms: int = 0  # the lock server's clock (Unix ms) at the read: compare the holder's times
    slot: int = 0  # which of ``limit`` slots (a lock with several holders)

    @property
    def label(self) -> str:
        """The resource as people read it: with the slot for a lock with a limit
        (``api:m slot 2 of 5``), the resource alone for a plain lock."""
        if self.limit > 1 or self.slot:
            return f"{self.resource} slot {self.slot} of {self.limit}"
        return self.resource


def active_locks(
    family: str | None = None, limit: int = 500, total: int | None = None
) -> list[ActiveLock]:
    """Locks held right now, longest-held first: at most ``limit`` index entries per family (the
    soonest to expire) and, with ``total``, about ``total`` shared between the families."""
    names = [family] if family else index.families()
    if total is not None and names:
        limit = max(1, min(limit, -(-total // len(names))))
    entries = index.members(names, limit)
    if not entries:
        return []
    hashes = read_many(client(), [entry.key for entry in entries])
    found: list[ActiveLock] = []
    stale: list[index.Member] = []
    for entry, (held, pttl, server_ms) in zip(entries, hashes, strict=True):
        if held is None or held.owner != entry.owner:
            if not entry.job_id:  # a job's entry is the liveness sweep's, to free its slot first
                stale.append(entry)
            continue
        found.append(
            ActiveLock(
                **held.holder(),
                resource=entry.resource,
                family=entry.family,
                owner=entry.owner,
                pttl_ms=pttl,
                held_for=held.seconds_held(server_ms),
                read_ms=server_ms,
                slot=entry.slot,
            )
        )
    index.drop(stale)
    return sorted(found, key=lambda row: -row.held_for)


def queue_of(spec: Any, *, log: bool = False) -> Any:
    """The queue of a ``@locked_job``'s spec, or None (logged with ``log``) if its name does not
    resolve: system check E006 reports it, and one bad name cannot break a page."""
    try:
        return get_queue(spec.queue)
    except (JoblockConfigError, ValueError) as exc:
        if log:
            logger.warning("queue of %s cannot be resolved: %s", spec.name, exc)
        return None


def requeueing_queues() -> dict[str, Any]:
    """Name -> queue of every resolvable asynchronous queue a requeueing ``@locked_job`` uses
    (a synchronous queue runs its jobs inline: they never requeue)."""
    found: dict[str, Any] = {}
    for spec in registered_jobs():
        name = queue_name(spec.queue)
        if spec.on_conflict is OnConflict.REQUEUE and name not in found:
            if (queue := queue_of(spec)) is not None and queue.is_async:
                found[name] = queue
    return found


def has_scheduler(queue: Any, client: Any = None) -> bool:
    """Does an RQ scheduler serve ``queue``? (Its lock, on ``client`` or the queue's connection.)"""
    return bool((client or queue.connection).exists(RQScheduler.get_locking_key(queue.name)))

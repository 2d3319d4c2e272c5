"""The active locks and the queues' schedulers, as the pages, commands and alerts show them.

Active locks are read from the active-lock index (:mod:`django_joblock.locks.index`, which
prunes expired entries while reading) and the lock hashes (:mod:`django_joblock.locks.info`);
an entry whose lock hash is gone or another owner's is dropped from the index here. No
``KEYS``, no whole-keyspace ``SCAN``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rq.scheduler import RQScheduler

from .. import conf
from ..backend import client
from ..exceptions import JoblockConfigError
from ..jobs.decorator import registered_jobs
from ..jobs.queues import get_queue, queue_name
from ..jobs.spec import OnConflict
from ..locks import index
from ..locks.info import Holder, read_many


@dataclass(frozen=True)
class ActiveLock(Holder):
    """One held lock, its holder and how long it was held."""

    resource: str
    family: str
    owner: str
    pttl_ms: int
    held_for: float  # seconds, on the lock server's clock
    # The lock server's clock (Unix ms, ``TIME``) when the row was read: the holder's times
    # are compared with it, never with this machine's clock.
    read_ms: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def active_locks(
    family: str | None = None, limit: int = 500, total: int | None = None
) -> list[ActiveLock]:
    """Locks held right now, longest-held first.

    Reads at most ``limit`` index entries per family (the soonest to expire) and, with
    ``total``, about ``total`` overall shared between the families: the cost is bounded by
    what is shown, never by how many locks exist.
    """
    names = [family] if family else index.families()
    if total is not None and names:
        limit = max(1, min(limit, -(-total // len(names))))
    entries = index.members(names, limit)
    if not entries:
        return []
    hashes = read_many(client(conf.get().REDIS_ALIAS), [entry[1] for entry in entries])
    found, stale = [], []
    for (fam, resource, owner), (held, pttl, server_ms) in zip(entries, hashes, strict=True):
        if held is None or held.owner != owner:
            stale.append((fam, resource, owner))
            continue
        found.append(
            ActiveLock(
                **held.holder(),
                resource=resource,
                family=fam,
                owner=owner,
                pttl_ms=pttl,
                held_for=held.seconds_held(server_ms),
                read_ms=server_ms,
            )
        )
    index.drop(stale)
    return sorted(found, key=lambda row: -row.held_for)


def requeueing_queues() -> dict[str, Any]:
    """Name -> queue of every asynchronous queue a requeueing ``@locked_job`` uses (a queue
    whose name cannot be resolved is left out: system check E006 reports it)."""
    found: dict[str, Any] = {}
    for spec in registered_jobs():
        name = queue_name(spec.queue)
        if spec.on_conflict is not OnConflict.REQUEUE or name in found:
            continue
        try:
            queue = get_queue(spec.queue)
        except (JoblockConfigError, ValueError):
            continue
        if queue.is_async:  # a synchronous queue runs its jobs inline: they never requeue
            found[name] = queue
    return found


def has_scheduler(queue: Any, client: Any = None) -> bool:
    """Does an RQ scheduler serve ``queue``? (RQ's scheduler lock, read on the queue's
    connection or on ``client``, a client of the same server.)"""
    return bool((client or queue.connection).exists(RQScheduler.get_locking_key(queue.name)))


def queues_without_scheduler() -> list[str]:
    """Queues of requeueing ``@locked_job`` functions that no RQ scheduler serves."""
    return [name for name, queue in requeueing_queues().items() if not has_scheduler(queue)]

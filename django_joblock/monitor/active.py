"""What the admin, the commands, the Prometheus exporter and the alerts show about locks and
schedulers, composed from the owners of the structures they read.

The active locks come from the active-lock index (:mod:`django_joblock.locks.index`, which
prunes expired entries while reading) and the lock hashes (:mod:`django_joblock.locks.info`);
entries whose lock hash is gone or another owner's are dropped from the index here. Metrics
are read with :mod:`django_joblock.metrics`. No ``KEYS``, no whole-keyspace ``SCAN``.
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


def _client() -> Any:
    return client(conf.get().REDIS_ALIAS)


# -- active locks ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ActiveLock(Holder):
    """One row of the active-lock pages: a held lock, its holder and how long it was held."""

    resource: str
    family: str
    owner: str
    pttl_ms: int
    held_for: float  # seconds, on the lock server's clock
    # The lock server's clock (Unix ms, ``TIME``) when this row was read: acquired / renewed
    # times are compared with it, never with this machine's clock.
    read_ms: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def active_locks(
    family: str | None = None, limit: int = 500, total: int | None = None
) -> list[ActiveLock]:
    """Locks held right now, with their holders, longest-held first.

    At most ``limit`` per family and, with ``total``, about ``total`` overall (shared between
    the families), soonest-to-expire first within a family: the cost is bounded by what is
    shown, never by how many locks exist. Index entries whose lock hash is gone or owned by
    someone else are skipped (and dropped from the index).
    """
    names = [family] if family else index.families()
    if total is not None and names:
        limit = max(1, min(limit, -(-total // len(names))))
    entries = index.members(names, limit)
    if not entries:
        return []
    hashes = read_many(_client(), [resource for _fam, resource, _owner in entries])
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
    found.sort(key=lambda row: -row.held_for)
    return found


# -- scheduler -------------------------------------------------------------------------------
def requeueing_queues() -> dict[str, Any]:
    """Name -> queue of every queue a requeueing ``@locked_job`` uses. A queue whose name
    cannot be resolved is left out (system check E006 reports it), and so is a synchronous
    queue (``is_async=False``): its jobs run inline and never requeue."""
    found: dict[str, Any] = {}
    for spec in registered_jobs():
        name = queue_name(spec.queue)
        if spec.on_conflict is not OnConflict.REQUEUE or name in found:
            continue
        try:
            queue = get_queue(spec.queue)
        except (JoblockConfigError, ValueError):
            continue
        if queue.is_async:
            found[name] = queue
    return found


def has_scheduler(queue: Any, client: Any = None) -> bool:
    """Does an RQ scheduler serve ``queue``? (RQ's scheduler lock, on the queue's connection
    or ``client``, a client on the same server.)"""
    return bool((client or queue.connection).exists(RQScheduler.get_locking_key(queue.name)))


def queues_without_scheduler() -> list[str]:
    """Queues used by requeueing ``@locked_job`` functions that no RQ scheduler serves."""
    return [name for name, queue in requeueing_queues().items() if not has_scheduler(queue)]

"""Removing what django-joblock wrote to Redis, for an uninstall (``joblock_purge --redis``).

Every key the app writes lives under ``JOBLOCK["KEY_PREFIX"] + ":"`` (locks, fence counters,
operator notes, the active-lock index, the families set, metric buckets and totals; see
:mod:`django_joblock.keys`). Most expire on their own, but the index, the families set and the
metric totals do not, so an uninstall would leave them behind forever. The keys a job's run
writes next to its RQ job (the family's timeline, the idempotency key's delivery history) are
on the Redis of its queue, which may be another database or server than the locks': the purge
walks the lock Redis and the Redis of every known queue (each server and database once).

This is the one place that walks the keyspace (``SCAN MATCH <prefix>:*``, never ``KEYS``):
it is an operator's one-off command, not a page or a hot path, and a ``SCAN`` is the only way
to also find the keys of locks and fences nobody indexes any more. Keys outside the prefix
(RQ's own, the Django cache's) are never touched.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .. import conf
from ..backend import connection, text
from ..jobs.queues import server_of
from ..locks.index import active_counts
from .health import queue_connections

BATCH = 500


@dataclass
class Purge:
    """What a purge found (and removed unless it was a dry run), by kind of key."""

    kinds: Counter[str] = field(default_factory=Counter)
    removed: int = 0

    @property
    def found(self) -> int:
        return sum(self.kinds.values())


def _kind(key: str, prefix: str) -> str:
    rest = key[len(prefix) + 1 :]
    if rest.startswith("{metrics}"):
        return "metrics"
    if rest.startswith("{"):
        # lock, fence, queue, tickets, wake (the waiting line), released (an operator's note)
        return rest.partition("}:")[2].split(":", 1)[0]
    return rest.split(":", 1)[0]  # active (index), families


def held_locks() -> int:
    """How many locks are held right now (by the active-lock index)."""
    return sum(active_counts().values())


def purge_redis(*, dry_run: bool = False, client: Any = None) -> Purge:
    """Find (and unless ``dry_run``, ``UNLINK``) every key under the app's prefix: on
    ``client`` only, or by default on the lock Redis and on the Redis of every known queue
    (see the module docs)."""
    prefix = conf.get().KEY_PREFIX
    result = Purge()
    for each in [client] if client is not None else _clients():
        _purge(each, prefix, result, dry_run)
    return result


def _clients() -> list[Any]:
    """The lock Redis and each other server / database that a known queue is on."""
    locks = connection(conf.get().REDIS_ALIAS)
    found = {server_of(locks): locks}
    for each in queue_connections():
        found.setdefault(server_of(each), each)
    return list(found.values())


def _purge(client: Any, prefix: str, result: Purge, dry_run: bool) -> None:
    batch: list[str] = []
    for raw in client.scan_iter(match=f"{prefix}:*", count=1000):
        key = text(raw)
        result.kinds[_kind(key, prefix)] += 1
        if dry_run:
            continue
        batch.append(key)
        if len(batch) >= BATCH:
            result.removed += int(client.unlink(*batch))
            batch = []
    if batch:
        result.removed += int(client.unlink(*batch))

"""Removing what django-joblock wrote to Redis, for an uninstall (``joblock_purge --redis``).

Every key the app writes lives under ``JOBLOCK["KEY_PREFIX"] + ":"`` (locks, fence counters,
operator notes, the active-lock index, the families set, metric buckets and totals; see
:mod:`django_joblock.keys`). Most expire on their own, but the index, the families set and the
metric totals do not, so an uninstall would leave them behind forever.

This is the one place that walks the keyspace (``SCAN MATCH <prefix>:*``, never ``KEYS``):
it is an operator's one-off command, not a page or a hot path, and a ``SCAN`` is the only way
to also find the keys of locks and fences nobody indexes any more. Keys outside the prefix
(RQ's own, the Django cache's) are never touched.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from . import conf
from .active_index import active_counts
from .backend import connection, text

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
    """Find (and unless ``dry_run``, ``UNLINK``) every key under the app's prefix."""
    prefix = conf.get().KEY_PREFIX
    client = client or connection(conf.get().REDIS_ALIAS)
    result = Purge()
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
    return result

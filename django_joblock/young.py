"""Locks whose holder died before the active-lock index listed them (they "died young").

The renewal thread writes a lock to the index once it has been held ``INDEX_DELAY`` (0.5 s):
that keeps acquire and release at one round trip each and keeps short locks out of the index
entirely (:mod:`django_joblock.active_index`). The price: a holder SIGKILLed within that half
second leaves a lock that nobody lists until its TTL ends.

For RQ jobs such a lock is found from RQ's side instead, with reads only where it is shown
(the dashboard, ``joblock_locks``, ``joblock_reap``), never on acquire or release:

- the candidates are the jobs of every known queue in RQ's started registry, and the newest
  :data:`SCAN` of its failed and scheduled registries (a horse killed mid-job leaves its job
  failed, or scheduled for its retry);
- a candidate that is a registered ``@locked_job`` gives its resource from its arguments;
- a lock hash on that resource that is held by that very job (its job id) and is missing from
  the index is reported, like an indexed one, and judged by :mod:`health` the same way.

A ``lock()`` outside RQ that dies young stays invisible until its TTL ends. Registries are
read with ``cleanup=False``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from rq.registry import FailedJobRegistry, ScheduledJobRegistry, StartedJobRegistry

from . import active_index, conf
from .backend import connection
from .health import fetch_jobs, known_queues
from .holders import read_many
from .jobs import registry
from .keys import family as family_of
from .monitoring import ActiveLock

__all__ = ["SCAN", "merge", "unindexed", "with_young"]

logger = logging.getLogger("django_joblock")

#: Newest entries read from each queue's failed and scheduled registries (all started ones).
SCAN = 100


def with_young(
    locks: list[ActiveLock],
    family: str | None = None,
    *,
    per_family: int | None = None,
    total: int | None = None,
) -> list[ActiveLock]:
    """``locks`` (from the index) and the job locks missing from it: see :func:`merge`."""
    return merge(locks, unindexed(locks, family), per_family=per_family, total=total)


def merge(
    locks: list[ActiveLock],
    young: list[ActiveLock],
    *,
    per_family: int | None = None,
    total: int | None = None,
) -> list[ActiveLock]:
    """``locks`` and ``young`` longest-held first, at most ``per_family`` of a family and
    ``total`` in all (the limits the caller read the index with hold for both)."""
    rows = sorted([*locks, *young], key=lambda row: -row.held_for)
    if per_family is not None:
        seen: dict[str, int] = {}
        kept = []
        for row in rows:
            seen[row.family] = seen.get(row.family, 0) + 1
            if seen[row.family] <= per_family:
                kept.append(row)
        rows = kept
    return rows if total is None else rows[:total]


def unindexed(listed: Iterable[ActiveLock], family: str | None = None) -> list[ActiveLock]:
    """The locks of RQ jobs that are not in the active-lock index (see the module docs), of
    ``family`` only when given. ``listed`` are index entries the caller read already; one that
    a limit left out is asked about in the index, so it never counts as unindexed."""
    known = {(row.resource, row.owner) for row in listed}
    wanted: dict[str, set[str]] = {}  # resource -> the job ids that may hold it
    for job in _candidates():
        spec = registry.get(job.func_name or "")
        if spec is None or spec.lock is None:
            continue
        try:
            resource = spec.resource(spec.bind(tuple(job.args), dict(job.kwargs)))
        except Exception:  # noqa: BLE001 - a job whose arguments no longer bind holds nothing
            continue
        if resource is None or (family is not None and family_of(resource) != family):
            continue
        wanted.setdefault(resource, set()).add(str(job.id))
    if not wanted:
        return []
    resources = sorted(wanted)
    hashes = read_many(connection(conf.get().REDIS_ALIAS), resources)
    found = []
    for resource, (held, pttl, server_ms) in zip(resources, hashes, strict=True):
        if held is None or held.job_id not in wanted[resource]:
            continue
        owner = held.owner
        if (resource, owner) in known:
            continue
        found.append(
            ActiveLock(
                **held.holder(),
                resource=resource,
                family=family_of(resource),
                owner=owner,
                pttl_ms=pttl,
                held_for=held.seconds_held(server_ms),
                read_ms=server_ms,
            )
        )
    if found:
        listed_now = active_index.indexed([(row.resource, row.owner) for row in found])
        found = [row for row in found if (row.resource, row.owner) not in listed_now]
    return found


def _candidates() -> list[Any]:
    jobs: list[Any] = []
    for queue in known_queues().values():
        ids = StartedJobRegistry(queue=queue).get_job_ids(cleanup=False)
        for kind in (FailedJobRegistry, ScheduledJobRegistry):
            ids += kind(queue=queue).get_job_ids(-SCAN, -1, cleanup=False)  # the newest
        if ids:
            jobs += fetch_jobs(queue, list(dict.fromkeys(ids)))
    return jobs

"""Is a lock's holder alive? Which RQ jobs and idempotency claims are stuck? (read-only)

RQ's state is read with RQ's key helpers on the job's queue's connection (for a ``lock()`` in a
plain RQ job, every known queue: a job found on none is unknown, never evidence), registries
with ``cleanup=False``, times on one server's clock. ``holder dead`` needs no renewal in the
last half TTL *and* evidence (``why``); ``not renewing`` is never reaped (left to expire);
``overdue`` is held past ``STUCK_AFTER``. See docs/operations.md ("Health of a lock")."""

from __future__ import annotations

import enum
import functools
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.utils import timezone
from rq import Worker
from rq.registry import StartedJobRegistry

from .. import conf
from ..backend import text
from ..choices import RecordStatus
from ..jobs import history
from ..jobs.decorator import registered_jobs, registry
from ..jobs.queues import configured_names, get_queue, queue_name, server_of
from ..locks.info import HOST
from ..models import IdempotencyRecord
from .active import ActiveLock, queue_of


class Health(enum.StrEnum):
    """The health of a lock's holder (the values are what pages and JSON show)."""

    HEALTHY = "healthy"
    DEAD = "holder dead"
    SILENT = "not renewing"
    OVERDUE = "overdue"


@dataclass(frozen=True)
class LockHealth:
    """A lock's health, and for ``holder dead`` the evidence (``why``)."""

    state: Health
    why: str = ""


def known_queues() -> dict[str, Any]:
    """Name -> queue of the ``@locked_job`` functions (those that resolve) and of ``RQ_QUEUES``."""
    found: dict[str, Any] = {}
    for spec in registered_jobs():
        name = queue_name(spec.queue)
        if name not in found and (queue := queue_of(spec, log=True)) is not None:
            found[name] = queue
    found |= {name: get_queue(name) for name in configured_names() if name not in found}
    return dict(sorted(found.items()))


def job_queue(job_func: str) -> Any:
    """The queue a registered ``@locked_job`` function (by dotted name) is enqueued on."""
    spec = registry.get(job_func)
    return None if spec is None else queue_of(spec)


def _where(queue: Any) -> tuple[Any, ...]:
    """Where RQ keeps a queue's jobs: its server, database and job key prefix."""
    return (*server_of(queue.connection), str(queue.job_class.key_for("")))


def _distinct_queues() -> list[Any]:
    found: dict[tuple[Any, ...], Any] = {}
    for queue in known_queues().values():
        found.setdefault(_where(queue), queue)
    return list(found.values())


def queue_connections() -> list[Any]:
    """One connection per distinct Redis server and database among the known queues."""
    return [queue.connection for queue in _distinct_queues()]


def _read_rq(locks: list[ActiveLock]) -> dict[int, tuple[str | None, bool]]:
    """Index in ``locks`` -> (its RQ job's status, None if gone; whether its worker exists),
    for the jobs found and for those whose own queue was asked (so "not found" means gone).
    One pipeline per :func:`_where`."""
    queue_for = functools.cache(job_queue)
    everywhere = functools.cache(_distinct_queues)
    asks: dict[tuple[Any, ...], tuple[Any, list[tuple[int, bool]]]] = {}
    for position, active in enumerate(locks):
        if active.job_id:
            queue = queue_for(active.job_func)
            for each in everywhere() if queue is None else [queue]:
                asks.setdefault(_where(each), (each, []))[1].append((position, queue is not None))
    seen: dict[int, tuple[str | None, bool]] = {}
    for queue, wanted in asks.values():
        pipe = queue.connection.pipeline(transaction=False)
        for position, _known in wanted:
            active = locks[position]
            pipe.hget(str(queue.job_class.key_for(active.job_id)), "status")
            if active.worker:
                pipe.exists(Worker.redis_worker_namespace_prefix + active.worker)
            else:
                pipe.echo("1")
        replies = pipe.execute()
        statuses = replies[::2]
        workers = replies[1::2]
        for (position, known), status, worker in zip(wanted, statuses, workers, strict=True):
            if status is not None or known:
                status = None if status is None else text(status)
                seen.setdefault(position, (status, bool(int(worker))))
    return seen


def _evidence(active: ActiveLock, seen: tuple[str | None, bool] | None) -> list[str]:
    found = []
    if active.job_id and seen is not None:
        status, worker_exists = seen
        if status is None:
            found.append(f"RQ job {active.job_id} is gone")
        elif status != "started":
            found.append(f"RQ job {active.job_id} is {status}, not started")
        if active.worker and not worker_exists:
            found.append(f"RQ worker {active.worker} is gone")
    if active.host == HOST and active.pid is not None:
        try:
            os.kill(active.pid, 0)
        except ProcessLookupError:
            found.append(f"process {active.pid} on {active.host} is gone")
        except PermissionError:
            pass  # another user's process
    return found


def holder_health(locks: list[ActiveLock]) -> list[LockHealth]:
    """The health of each holder in ``locks``, in their order (a lock with a limit has a row,
    so a health, per slot held), with one pipelined read per Redis server RQ uses."""
    seen = _read_rq(locks) if locks else {}
    limit = conf.get().STUCK_AFTER
    return [_judge(active, seen.get(position), limit) for position, active in enumerate(locks)]


def _judge(active: ActiveLock, seen: tuple[str | None, bool] | None, limit: float) -> LockHealth:
    """One holder's health, from its RQ job and worker as :func:`_read_rq` saw them (``seen``)
    and ``STUCK_AFTER`` (``limit``, seconds)."""
    # Both times are on the lock's Redis server clock.
    since = max(0, active.read_ms - (active.renewed_ms or active.acquired_ms or 0))
    # A renewal in the last half TTL proves a live renewal thread (e.g. an orphaned work
    # horse whose worker died); a lock never renewed proves nothing either way.
    young = since < (active.ttl_ms or 0) / 2
    renewing = bool(active.renewals) and young
    evidence = _evidence(active, seen)
    # A plain lock() may have its heartbeat off: never renewed is then no sign.
    spec = registry.get(active.job_func) if active.job_id else None
    beats = bool(active.renewals) or (spec is not None and spec.heartbeat)
    if evidence and not renewing:
        never = " (never renewed)" if not active.renewals else ""
        why = "; ".join([*evidence, f"not renewed for {since / 1000:.0f}s{never}"])
        return LockHealth(Health.DEAD, why)
    if beats and not young:
        if active.renewals:
            renewed = f"renewed {active.renewals} times, the last {since / 1000:.1f}s"
        else:  # a job whose heartbeat renews by TTL / 3
            renewed = f"never renewed in {since / 1000:.1f}s"
        why = (
            f"{renewed} ago (TTL {(active.ttl_ms or 0) / 1000:g}s): its heartbeat stopped; "
            f"it expires in {max(0, active.pttl_ms) / 1000:.1f}s"
        )
        return LockHealth(Health.SILENT, why)
    if active.held_for > limit:
        why = f"held {active.held_for:.0f}s, longer than STUCK_AFTER {limit:g}s"
        return LockHealth(Health.OVERDUE, why)
    return LockHealth(Health.HEALTHY)


@dataclass
class StuckJob:
    job_id: str
    queue: str
    func: str
    worker: str
    reason: str
    url: str = ""  # django-rq's page of the job, filled in by the admin when it has one


def stuck_jobs(limit: int = 200) -> list[StuckJob]:
    """RQ jobs (at most ``limit`` per queue) in the started registries of the known queues that
    have run past their timeout, by each queue server's clock."""
    found = []
    for name, queue in known_queues().items():
        ids = StartedJobRegistry(queue=queue).get_job_ids(0, limit - 1, cleanup=False)
        if not ids:
            continue
        seconds, micros = queue.connection.time()
        now = datetime.fromtimestamp(int(seconds) + int(micros) / 1e6, UTC)
        fetch = queue.job_class.fetch_many
        for job in fetch(ids, connection=queue.connection, serializer=queue.serializer):
            if job is None or job.started_at is None:
                continue
            started = job.started_at.replace(tzinfo=job.started_at.tzinfo or UTC)
            running = (now - started).total_seconds()
            timeout = job.timeout
            if timeout is not None and timeout >= 0 and running > timeout:
                who = (job.func_name or "", job.worker_name or "")
                reason = f"running {running:.0f}s, timeout {timeout}s"
                found.append(StuckJob(job.id, name, *who, reason))
    return found


def stuck_claims(limit: int = 50) -> list[Any]:
    """Idempotency records still ``running`` after their lease ran out (indexed query)."""
    late = IdempotencyRecord.objects.filter(lease_expires_at__lt=timezone.now())
    return list(late.filter(status=RecordStatus.RUNNING).order_by("lease_expires_at")[:limit])


def record_deliveries(scope: str, key: str, resource: str = "") -> list[history.Delivery]:
    """The runs of a record's key (``scope``: its job's dotted name; ``resource``, if locked, names
    their family), read on that job's queue connection; none for a scope no ``@locked_job`` has."""
    queue = job_queue(scope)
    return [] if queue is None else history.of_key([queue.connection], scope, key, resource)

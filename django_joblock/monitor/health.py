"""Is a lock's holder alive? Which RQ jobs and idempotency claims are stuck? (read-only)

RQ's state is read where RQ keeps it, with RQ's own key helpers (which follow rq 3's
``RQ_KEY_PREFIX``): on the connection of the job's queue, that of its registered
``@locked_job``. For any other job (a ``lock()`` in a plain RQ job) every known queue is
asked, and a job found on none is *unknown*, never evidence of death. Registries are read
with ``cleanup=False``: looking never moves or fails a job. Times are compared on one
server's clock: a lock's with its Redis server's ``TIME``, a started job's with its queue's.

- ``holder dead``: not renewed in the last half TTL (never renewed counts as not renewed)
  *and* positive evidence (``why``) that its holder is gone: its RQ job is gone or no longer
  ``started``, its RQ worker vanished, or (same host) its process is gone. A work horse that
  still renews is alive, whatever happened to its worker.
- ``not renewing``: renewed before, then not for over half its TTL, with no other evidence
  (seen before the lock expires, even outside RQ or on another host). Never reaped: a paused
  holder may still believe it holds the lock, so it is left to expire (the fence covers a
  late write).
- ``overdue``: held longer than ``JOBLOCK["STUCK_AFTER"]``; ``healthy`` otherwise.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.utils import timezone
from rq import Worker
from rq.registry import StartedJobRegistry

from .. import conf
from ..backend import text
from ..choices import RecordStatus
from ..exceptions import JoblockConfigError
from ..jobs import history
from ..jobs.decorator import registered_jobs, registry
from ..jobs.queues import configured_names, get_queue, queue_name, server_of
from .active import ActiveLock

_HOST = socket.gethostname()
logger = logging.getLogger("django_joblock")


class Health(enum.StrEnum):
    """The health of a lock's holder (the values are what pages and JSON show)."""

    HEALTHY = "healthy"
    DEAD = "holder dead"
    SILENT = "not renewing"
    OVERDUE = "overdue"


HEALTHY, DEAD, SILENT, OVERDUE = Health.HEALTHY, Health.DEAD, Health.SILENT, Health.OVERDUE


@dataclass(frozen=True)
class LockHealth:
    """A lock's health, and for ``holder dead`` the evidence (``why``)."""

    state: Health
    why: str = ""


def known_queues() -> dict[str, Any]:
    """Name -> queue for the queues of the registered ``@locked_job`` functions and of
    django-rq's ``RQ_QUEUES``. A job whose queue cannot be resolved is logged and left out
    (system check E006 reports it): one bad name cannot break a page."""
    found: dict[str, Any] = {}
    for spec in registered_jobs():
        name = queue_name(spec.queue)
        if name in found:
            continue
        try:
            found[name] = get_queue(spec.queue)
        except (JoblockConfigError, ValueError) as exc:
            logger.warning("queue of %s cannot be resolved: %s", spec.name, exc)
    for name in configured_names():
        if name not in found:
            found[name] = get_queue(name)
    return dict(sorted(found.items()))


def job_queue(job_func: str) -> Any:
    """The queue a registered ``@locked_job`` function (by dotted name) is enqueued on."""
    spec = registry.get(job_func)
    try:
        return None if spec is None else get_queue(spec.queue)
    except (JoblockConfigError, ValueError):
        return None


def _job_key(queue: Any, job_id: str) -> str:
    return str(queue.job_class.key_for(job_id))


def _where(queue: Any) -> tuple[Any, ...]:
    """Where RQ keeps a queue's jobs: its server, database and job key prefix."""
    return (*server_of(queue.connection), _job_key(queue, ""))


def _distinct_queues() -> list[Any]:
    """One known queue per distinct :func:`_where`."""
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
    queue_of = functools.cache(job_queue)
    everywhere = functools.cache(_distinct_queues)
    asks: dict[tuple[Any, ...], tuple[Any, list[tuple[int, bool]]]] = {}
    for position, active in enumerate(locks):
        if active.job_id:
            queue = queue_of(active.job_func)
            for each in everywhere() if queue is None else [queue]:
                asks.setdefault(_where(each), (each, []))[1].append((position, queue is not None))
    seen: dict[int, tuple[str | None, bool]] = {}
    for queue, wanted in asks.values():
        pipe = queue.connection.pipeline(transaction=False)
        for position, _known in wanted:
            active = locks[position]
            pipe.hget(_job_key(queue, active.job_id), "status")
            if active.worker:
                pipe.exists(Worker.redis_worker_namespace_prefix + active.worker)
            else:
                pipe.echo("1")
        replies = pipe.execute()
        for (position, known), status, worker in zip(
            wanted, replies[::2], replies[1::2], strict=True
        ):
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
    if active.host == _HOST and active.pid is not None:
        try:
            os.kill(active.pid, 0)
        except ProcessLookupError:
            found.append(f"process {active.pid} on {active.host} is gone")
        except PermissionError:
            pass  # another user's process
    return found


def lock_health(locks: list[ActiveLock]) -> dict[str, LockHealth]:
    """resource -> health, with one pipelined read per Redis server RQ uses."""
    seen = _read_rq(locks) if locks else {}
    stuck_after = conf.get().STUCK_AFTER
    found = {}
    for position, active in enumerate(locks):
        # Both times are on the lock's Redis server clock.
        since_renewal = max(0, active.read_ms - (active.renewed_ms or active.acquired_ms or 0))
        # A renewal in the last half TTL proves a live renewal thread (e.g. an orphaned work
        # horse whose worker died); a lock never renewed proves nothing either way.
        renewing = bool(active.renewals) and since_renewal < (active.ttl_ms or 0) / 2
        evidence = _evidence(active, seen.get(position))
        if evidence and not renewing:
            never = " (never renewed)" if not active.renewals else ""
            why = "; ".join([*evidence, f"not renewed for {since_renewal / 1000:.0f}s{never}"])
            health = LockHealth(DEAD, why)
        elif active.renewals and not renewing:
            health = LockHealth(
                SILENT,
                f"renewed {active.renewals} times, the last {since_renewal / 1000:.1f}s ago "
                f"(TTL {(active.ttl_ms or 0) / 1000:g}s): its heartbeat stopped; it expires "
                f"in {max(0, active.pttl_ms) / 1000:.1f}s",
            )
        elif active.held_for > stuck_after:
            health = LockHealth(
                OVERDUE, f"held {active.held_for:.0f}s, longer than STUCK_AFTER {stuck_after:g}s"
            )
        else:
            health = LockHealth(HEALTHY)
        found[active.resource] = health
    return found


@dataclass
class StuckJob:
    job_id: str
    queue: str
    func: str
    worker: str
    started_at: datetime | None
    timeout: float | None
    running_for: float
    reason: str
    url: str = ""  # django-rq's page of the job, filled in by the admin when it has one


def stuck_jobs(queues: dict[str, Any] | None = None, limit: int = 200) -> list[StuckJob]:
    """RQ jobs (at most ``limit`` per queue) in the started registries of ``queues`` (default:
    the known queues) that have run past their timeout, by each queue server's clock."""
    found = []
    for name, queue in (known_queues() if queues is None else queues).items():
        ids = StartedJobRegistry(queue=queue).get_job_ids(0, limit - 1, cleanup=False)
        if not ids:
            continue
        seconds, micros = queue.connection.time()
        now = datetime.fromtimestamp(int(seconds) + int(micros) / 1e6, UTC)
        jobs = queue.job_class.fetch_many(
            ids, connection=queue.connection, serializer=queue.serializer
        )
        for job in jobs:
            if job is None or job.started_at is None:
                continue
            started = job.started_at.replace(tzinfo=job.started_at.tzinfo or UTC)
            running, timeout = (now - started).total_seconds(), job.timeout
            if timeout is not None and timeout >= 0 and running > timeout:
                who = (job.func_name or "", job.worker_name or "")
                reason = f"running {running:.0f}s, timeout {timeout}s"
                found.append(StuckJob(job.id, name, *who, started, timeout, running, reason))
    return found


def stuck_claims(limit: int = 50) -> list[Any]:
    """Idempotency records still ``running`` after their lease ran out (indexed query)."""
    from ..models import IdempotencyRecord

    return list(
        IdempotencyRecord.objects.filter(
            status=RecordStatus.RUNNING, lease_expires_at__lt=timezone.now()
        ).order_by("lease_expires_at")[:limit]
    )


def record_deliveries(scope: str, key: str, resource: str = "") -> list[history.Delivery]:
    """The runs of an idempotency record's key (``scope``: its job's dotted name; ``resource``,
    if it had a lock, names the family they are kept under), read on that job's queue
    connection; empty for a scope no ``@locked_job`` has."""
    queue = job_queue(scope)
    return [] if queue is None else history.of_key([queue.connection], scope, key, resource)

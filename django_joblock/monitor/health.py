"""Is a lock's holder alive? Which RQ jobs and idempotency claims are stuck? (read-only)

RQ's state is read where RQ keeps it: on the connection of the *queue* the job was enqueued
on (which may be another Redis database or server than the locks'), with RQ's own key helpers
(``Job.key_for`` of the queue's job class, the worker class's key prefix; both follow rq 3's
``RQ_KEY_PREFIX``). The queue of a lock's job is the queue of its registered ``@locked_job``
function; for other jobs (a ``lock()`` inside a plain RQ job) every known queue connection is
asked, and a job found on none of them is *unknown*, never evidence of death. Registries are
read with ``cleanup=False``: looking never moves or fails anybody's job.

Times are compared on one clock: a lock's renewal times come from its Redis server's ``TIME``
and are compared with that server's ``TIME`` read together with the lock; a started RQ job's
run time is measured with its queue server's ``TIME``.

A lock's health is one of:

- ``holder dead``: no renewal in the last half TTL (a lock never renewed counts as not
  renewed), *and* positive evidence its holder is gone: its RQ job no longer exists or is no
  longer ``started``, its RQ worker has vanished, or (same host) its process id does not exist.
  An orphaned work horse that still heartbeats is alive, whatever happened to its worker.
  ``why`` names the evidence that applied.
- ``not renewing``: it was renewed before (so its holder runs a heartbeat) and then not for
  more than half its TTL, with no other evidence: judged by the lock's own heartbeat, so a
  holder outside RQ or on another host that died (or hangs) is seen before its lock expires.
  Never reaped or force-released as dead: a paused process may still believe it holds the
  lock until its TTL, so the lock is left to expire (the fence covers a late write).
- ``overdue``: held longer than ``JOBLOCK["STUCK_AFTER"]``;
- ``healthy`` otherwise.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
from collections import defaultdict
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
    django-rq's ``RQ_QUEUES``. A job whose queue cannot be resolved is left out (system check
    ``django_joblock.E006`` reports it) and logged, so one bad name cannot break a page."""
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
    if spec is None:
        return None
    try:
        return get_queue(spec.queue)
    except (JoblockConfigError, ValueError):
        return None


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class _Place:
    """Where RQ keeps the state of some queue: a connection and the job / worker key helpers."""

    connection: Any
    job_class: Any
    worker_prefix: str

    def job_key(self, job_id: str) -> str:
        return str(self.job_class.key_for(job_id))

    def worker_key(self, name: str) -> str:
        return self.worker_prefix + name


def _place(queue: Any) -> _Place:
    return _Place(queue.connection, queue.job_class, Worker.redis_worker_namespace_prefix)


def _all_places() -> list[_Place]:
    """One place per distinct (server, database, job key prefix) among the known queues."""
    places: dict[tuple[Any, ...], _Place] = {}
    for queue in known_queues().values():
        place = _place(queue)
        places.setdefault((*server_of(queue.connection), place.job_key("")), place)
    return list(places.values())


def queue_connections() -> list[Any]:
    """One connection per distinct Redis server and database among the known queues."""
    return [place.connection for place in _all_places()]


@dataclass
class _Seen:
    """What RQ says about one lock's job and worker (None: not looked at / not found)."""

    status: str | None = None
    job_found: bool = False
    worker_found: bool | None = None
    known: bool = False  # the job's own queue was asked, so "not found" means gone


def _read_rq(locks: list[ActiveLock]) -> dict[int, _Seen]:
    """Index in ``locks`` -> what RQ says, one pipeline per distinct Redis server/database."""
    queues: dict[str, Any] = {}
    everywhere: list[_Place] | None = None
    asks: dict[tuple[Any, ...], tuple[_Place, list[tuple[int, bool]]]] = {}
    for index, active in enumerate(locks):
        if not active.job_id:
            continue
        if active.job_func not in queues:
            queues[active.job_func] = job_queue(active.job_func)
        queue = queues[active.job_func]
        if queue is not None:
            candidates, known = [_place(queue)], True
        else:
            if everywhere is None:
                everywhere = _all_places()
            candidates, known = everywhere, False
        for place in candidates:
            server = (*server_of(place.connection), place.job_key(""))
            asks.setdefault(server, (place, []))[1].append((index, known))
    seen: dict[int, _Seen] = defaultdict(_Seen)
    for place, wanted in asks.values():
        pipe = place.connection.pipeline(transaction=False)
        for index, _known in wanted:
            active = locks[index]
            pipe.hget(place.job_key(active.job_id), "status")
            if active.worker:
                pipe.exists(place.worker_key(active.worker))
            else:
                pipe.echo("1")
        replies = pipe.execute()
        for position, (index, known) in enumerate(wanted):
            status, worker = replies[2 * position], replies[2 * position + 1]
            entry = seen[index]
            entry.known = entry.known or known
            if status is not None and not entry.job_found:
                entry.job_found, entry.status = True, text(status)
                entry.worker_found = bool(int(worker))
            elif known:
                entry.worker_found = bool(int(worker))
    return seen


def _evidence(active: ActiveLock, seen: _Seen | None) -> list[str]:
    found = []
    if active.job_id and seen is not None:
        if seen.job_found and seen.status != "started":
            found.append(f"RQ job {active.job_id} is {seen.status}, not started")
        elif not seen.job_found and seen.known:
            found.append(f"RQ job {active.job_id} is gone")
        if active.worker and (seen.job_found or seen.known) and seen.worker_found is False:
            found.append(f"RQ worker {active.worker} is gone")
    if active.host == _HOST and active.pid is not None and not _pid_exists(active.pid):
        found.append(f"process {active.pid} on {active.host} is gone")
    return found


def lock_health(locks: list[ActiveLock]) -> dict[str, LockHealth]:
    """resource -> health, with one pipelined read per Redis server RQ uses."""
    if not locks:
        return {}
    seen = _read_rq(locks)
    stuck_after = conf.get().STUCK_AFTER
    found = {}
    for index, active in enumerate(locks):
        # Both times come from the lock's Redis server clock.
        since_renewal = max(0, active.read_ms - (active.renewed_ms or active.acquired_ms or 0))
        # A renewal in the last half TTL proves a live renewal thread (e.g. an orphaned work
        # horse whose worker died); a lock never renewed proves nothing either way.
        renewing = bool(active.renewals) and since_renewal < (active.ttl_ms or 0) / 2
        evidence = _evidence(active, seen.get(index))
        if evidence and not renewing:
            never = " (never renewed)" if not active.renewals else ""
            why = "; ".join([*evidence, f"not renewed for {since_renewal / 1000:.0f}s{never}"])
            found[active.resource] = LockHealth(DEAD, why)
        elif active.renewals and not renewing:
            found[active.resource] = LockHealth(
                SILENT,
                f"renewed {active.renewals} times, the last {since_renewal / 1000:.1f}s ago "
                f"(TTL {(active.ttl_ms or 0) / 1000:g}s): its heartbeat stopped; it expires "
                f"in {max(0, active.pttl_ms) / 1000:.1f}s",
            )
        elif active.held_for > stuck_after:
            found[active.resource] = LockHealth(
                OVERDUE, f"held {active.held_for:.0f}s, longer than STUCK_AFTER {stuck_after:g}s"
            )
        else:
            found[active.resource] = LockHealth(HEALTHY)
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


def _server_now(client: Any) -> datetime:
    seconds, micros = client.time()
    return datetime.fromtimestamp(int(seconds) + int(micros) / 1e6, UTC)


def stuck_jobs(queues: dict[str, Any] | None = None, limit: int = 200) -> list[StuckJob]:
    """RQ jobs in the started registries of ``queues`` (default: the known queues) that have
    run past their timeout, measured with each queue server's clock."""
    found = []
    for name, queue in (known_queues() if queues is None else queues).items():
        registry = StartedJobRegistry(queue=queue)
        ids = registry.get_job_ids(0, limit - 1, cleanup=False)
        if not ids:
            continue
        now = _server_now(queue.connection)
        for job in fetch_jobs(queue, ids):
            if job.started_at is None:
                continue
            started = (
                job.started_at.replace(tzinfo=UTC)
                if job.started_at.tzinfo is None
                else job.started_at
            )
            running = (now - started).total_seconds()
            timeout = job.timeout
            if timeout is not None and timeout >= 0 and running > timeout:
                found.append(
                    StuckJob(
                        job.id,
                        name,
                        job.func_name or "",
                        job.worker_name or "",
                        started,
                        timeout,
                        running,
                        f"running {running:.0f}s, timeout {timeout}s",
                    )
                )
    return found


def fetch_jobs(queue: Any, ids: list[str]) -> list[Any]:
    """The RQ jobs ``ids`` of ``queue`` that still exist, in one pipelined read."""
    jobs = queue.job_class.fetch_many(ids, connection=queue.connection, serializer=queue.serializer)
    return [job for job in jobs if job is not None]


def stuck_claims(limit: int = 50) -> list[Any]:
    """Idempotency records still ``running`` after their lease ran out (indexed query)."""
    from ..models import IdempotencyRecord

    return list(
        IdempotencyRecord.objects.filter(
            status=RecordStatus.RUNNING, lease_expires_at__lt=timezone.now()
        ).order_by("lease_expires_at")[:limit]
    )


def record_deliveries(scope: str, key: str, resource: str = "") -> list[history.Delivery]:
    """The runs of an idempotency record's key (its ``scope`` is the job's dotted name; its
    ``resource``, when it had a lock, names the family they are kept under), read on that
    job's queue connection; empty for a scope no ``@locked_job`` has."""
    queue = job_queue(scope)
    return [] if queue is None else history.of_key([queue.connection], scope, key, resource)

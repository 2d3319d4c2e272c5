"""Is a lock's holder alive? Which RQ jobs and idempotency claims are stuck? (read-only)

RQ is read with plain ``HGET`` / ``EXISTS`` and registries with ``cleanup=False``: looking at a
registry never moves or fails anybody's job.

A lock's health is one of:

- ``holder dead``: no renewal in the last half TTL, *and* positive evidence its holder is
  gone: its RQ job no longer exists or is no longer started, its RQ
  worker has vanished, or (same host) its process id does not exist. An orphaned work horse
  that still heartbeats is alive, whatever happened to its worker.
- ``overdue``: held longer than ``JOBLOCK["STUCK_AFTER"]``;
- ``healthy`` otherwise.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from . import conf
from .monitoring import ActiveLock, _client, _text

HEALTHY, DEAD, OVERDUE = "healthy", "holder dead", "overdue"
_HOST = socket.gethostname()
WORKER_PREFIX = "rq:worker:"
JOB_PREFIX = "rq:job:"


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_health(locks: list[ActiveLock]) -> dict[str, str]:
    """resource -> health, with two pipelined reads for the whole list."""
    if not locks:
        return {}
    client = _client()
    pipe = client.pipeline(transaction=False)
    for held in locks:
        pipe.hget(JOB_PREFIX + held.job_id, "status") if held.job_id else pipe.echo("")
        pipe.exists(WORKER_PREFIX + held.worker) if held.worker else pipe.echo("1")
    replies = pipe.execute()
    now_ms = time.time() * 1000
    stuck_after = conf.get().STUCK_AFTER
    found = {}
    for index, held in enumerate(locks):
        status, worker_alive = replies[2 * index], replies[2 * index + 1]
        # A renewal in the last half TTL proves a live renewal thread (e.g. an orphaned work
        # horse whose worker died); a lock never renewed proves nothing either way.
        renewing = bool(held.renewals) and now_ms - (held.renewed_ms or 0) < (held.ttl_ms or 0) / 2
        evidence = (
            (held.job_id and _text(status or "") != "started")
            or (held.worker and not int(worker_alive))
            or (held.host == _HOST and held.pid is not None and not _pid_exists(held.pid))
        )
        if evidence and not renewing:
            found[held.resource] = DEAD
        elif held.held_for > stuck_after:
            found[held.resource] = OVERDUE
        else:
            found[held.resource] = HEALTHY
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


def stuck_jobs(queue_names: list[str], limit: int = 200) -> list[StuckJob]:
    """RQ jobs in the started registries that have run past their timeout."""
    from rq.job import Job
    from rq.registry import StartedJobRegistry

    from .queues import get_queue

    now = datetime.now(UTC)
    found = []
    for name in queue_names:
        queue = get_queue(name)
        registry = StartedJobRegistry(queue=queue)
        ids = registry.get_job_ids(0, limit - 1, cleanup=False)
        for job in Job.fetch_many(ids, connection=queue.connection):
            if job is None or job.started_at is None:
                continue
            started = (
                job.started_at.replace(tzinfo=UTC)
                if job.started_at.tzinfo is None
                else (job.started_at)
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


def stuck_claims(limit: int = 50) -> list[Any]:
    """Idempotency records still ``running`` after their lease ran out (indexed query)."""
    from django.utils import timezone

    from .models import IdempotencyRecord

    return list(
        IdempotencyRecord.objects.filter(
            status="running", lease_expires_at__lt=timezone.now()
        ).order_by("lease_expires_at")[:limit]
    )


def known_queues() -> list[str]:
    """Queues of the registered ``@locked_job`` functions (and django-rq's, if configured)."""
    from django.conf import settings

    from .checks import _job_specs
    from .queues import queue_name

    names = {queue_name(spec.queue) for spec in _job_specs()}
    names |= set(getattr(settings, "RQ_QUEUES", {}) or {})
    return sorted(names)

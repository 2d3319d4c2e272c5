"""Admission: a job whose resource is busy waits parked in RQ, not in a requeue loop (§4.8).

On rq >= 3.0, ``@locked_job`` enqueues every job that has a lock with RQ's own
``RateLimit(key=<the lock key>, concurrency=1)``. RQ then keeps at most one job per resource
queued or running, across all queues of that Redis connection, and parks the others (status
``rate_limited``). When the admitted job ends (finished, failed, stopped, or scheduled for a
retry), RQ's worker releases its slot after its own bookkeeping and pushes the oldest parked
job onto its queue. A parked job uses no worker, no scheduler poll and none of its retry
budget. Everything here goes through RQ's public ``enqueue`` options.

The lock inside the work horse stays the safety mechanism (TTL, heartbeat, fence, abort on
loss): admission only decides *when* a job starts, never whether two may hold the resource. A
job that finds the lock busy anyway (a ``lock()`` caller, a job on a queue of another Redis, a
job enqueued with ``admission=False``, an orphaned horse) requeues with backoff
(:mod:`.requeue`).

**FIFO.** RQ scores its waiting set in whole seconds and breaks ties by job id. A job
``@locked_job`` parks gets an id that sorts by its enqueue time (:func:`fifo_id`), so jobs of
the same second start in the order they were enqueued. A job given its own ``job_id`` (or a
``unique_key`` one) keeps RQ's order within a second.

What frees a slot, and so when the next parked job starts after a fault, is RQ's: the job's
end in its work horse; a killed work horse, at once (the worker parent fails or retries the
job); a dead worker process, at RQ's next maintenance after the job's execution expires
(docs/jobs.md gives the bounds).

Not applied (``job.meta["joblock"]["admission"]`` says why; such a job requeues on
contention): rq < 3.0 (``requeue_only``), ``admission=False`` (``off``), a synchronous queue
(``sync``), a caller's own ``rate_limit=`` (``caller_rate_limit``), RQ's ``unique=True``
(``rq_unique``) or ``pipeline=`` (``pipeline``), both of which RQ refuses with a rate limit,
and a queue or job class with its own key prefix (``key_prefix``, which RQ refuses too).
"""

from __future__ import annotations

import enum
import importlib
import secrets
import time
from typing import Any

from rq.job import Job
from rq.queue import Queue

from .. import conf
from ..locks.keys import LockKeys

RateLimit: Any = None
try:  # rq >= 3.0
    RateLimit = importlib.import_module("rq.rate_limit").RateLimit
except ImportError:  # rq 2.x: requeue only
    pass

PARKED = "rate_limited"  # RQ's JobStatus.RATE_LIMITED (rq >= 3.0)


class Admission(enum.StrEnum):
    """How a job waits for a busy resource: ``job.meta["joblock"]["admission"]``."""

    RATE_LIMIT = "rate_limit"  # parked by RQ's RateLimit until the running job ends
    OFF = "off"  # @locked_job(admission=False): requeue on contention
    REQUEUE_ONLY = "requeue_only"  # rq < 3.0 has no RateLimit
    SYNC = "sync"  # a synchronous queue runs the job inline at enqueue
    CALLER_RATE_LIMIT = "caller_rate_limit"  # the caller passed its own rate_limit=
    RQ_UNIQUE = "rq_unique"  # RQ's unique=True, which RQ refuses with a rate limit
    PIPELINE = "pipeline"  # enqueued in the caller's pipeline, which RQ refuses
    KEY_PREFIX = "key_prefix"  # a queue / job class with its own key prefix


def supported() -> bool:
    """True when the installed rq has ``RateLimit`` (rq >= 3.0)."""
    return RateLimit is not None


def key_for(resource: str) -> str:
    """The rate-limit key of a resource: its lock key (``joblock:{order:1}:lock``)."""
    return LockKeys(conf.get().KEY_PREFIX, resource).lock


def fifo_id() -> str:
    """A job id that sorts by the time it was made (then at random): RQ's tie-break within
    a second of its waiting set."""
    return f"{time.time_ns():016x}{secrets.token_hex(8)}"


def plan(queue: Any, resource: str, enabled: bool, options: dict[str, Any]) -> Admission:
    """Decide how a job on ``resource`` waits, adding ``rate_limit`` (and a :func:`fifo_id`
    when the caller gave no ``job_id``) to ``options`` if it is parked. ``options`` are the
    RQ options of the enqueue call (decoration-time and per-call merged)."""
    if not queue.is_async:
        return Admission.SYNC
    if not enabled:
        return Admission.OFF
    if not supported():
        return Admission.REQUEUE_ONLY
    if options.get("rate_limit") is not None:
        return Admission.CALLER_RATE_LIMIT
    if options.get("unique"):
        return Admission.RQ_UNIQUE
    if options.get("pipeline") is not None:
        return Admission.PIPELINE
    if (
        queue.job_class.redis_job_namespace_prefix != Job.redis_job_namespace_prefix
        or queue.redis_queue_namespace_prefix != Queue.redis_queue_namespace_prefix
    ):
        return Admission.KEY_PREFIX
    options["rate_limit"] = RateLimit(key=key_for(resource), concurrency=1)
    options.setdefault("job_id", fifo_id())
    return Admission.RATE_LIMIT

"""Admission: a job whose resource is busy waits parked in RQ, not in a requeue loop (§4.8).

On rq >= 3.0 a ``@locked_job`` with a lock is enqueued with RQ's own ``RateLimit(key=<its lock
key>, concurrency=1)``: RQ keeps at most one job per resource queued or running (across the
queues of that Redis connection) and parks the others (``rate_limited``) without using a worker
or their retry budget. When the admitted job ends (or is scheduled for a retry) RQ frees its
slot and pushes the oldest parked job; a killed work horse frees it at once, a dead worker at
RQ's next maintenance (docs/jobs.md). Parked jobs get ids that sort by enqueue time, so RQ's
tie-break keeps them FIFO within a second. Admission decides only *when* a job starts; the
lock stays the safety, and a job finding it busy anyway requeues (:mod:`.requeue`). Where
admission does not apply, ``job.meta["joblock"]["admission"]`` says why (:class:`Admission`).
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
    OFF = "off"  # @locked_job(admission=False)
    REQUEUE_ONLY = "requeue_only"  # rq < 3.0 has no RateLimit
    SYNC = "sync"  # a synchronous queue runs the job inline at enqueue
    CALLER_RATE_LIMIT = "caller_rate_limit"  # the caller passed its own rate_limit=
    RQ_UNIQUE = "rq_unique"  # RQ's unique=True, which RQ refuses with a rate limit
    PIPELINE = "pipeline"  # enqueued in the caller's pipeline, which RQ refuses too
    KEY_PREFIX = "key_prefix"  # a queue / job class with its own key prefix (RQ refuses)


def supported() -> bool:
    """True when the installed rq has ``RateLimit`` (rq >= 3.0)."""
    return RateLimit is not None


def plan(queue: Any, resource: str, enabled: bool, options: dict[str, Any]) -> Admission:
    """Decide how a job on ``resource`` waits; if parked, add ``rate_limit`` (and, without a
    ``job_id``, a time-sorted one) to ``options``, the enqueue call's merged RQ options."""
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
    key = LockKeys(conf.get().KEY_PREFIX, resource).lock  # joblock:{order:1}:lock
    options["rate_limit"] = RateLimit(key=key, concurrency=1)
    options.setdefault("job_id", f"{time.time_ns():016x}{secrets.token_hex(8)}")
    return Admission.RATE_LIMIT

"""Admission (docs/jobs.md): a job whose resource is busy waits parked in RQ, not in a requeue
loop. On rq >= 3.0 a job with a lock is enqueued with RQ's ``RateLimit(key=<its lock key>,
concurrency=N)`` (N = the job's ``concurrency``, 1 by default): RQ parks the others, using no
worker nor retry budget, until a slot frees (a killed horse's at once, a dead worker's at RQ's
next maintenance); time-sorted job ids keep them FIFO. Admission decides only *when* a job
starts; the lock stays the safety.

Its cost is RQ's: at each admitted job's end RQ's ``release_slot`` reads the limit's
``concurrency`` from Redis (a ``HGET``, one round trip) before its release script, although the
job carries it (``Job.rate_limit_concurrency``), and registers RQ's four scripts again. A fix
that belongs in RQ (``RateLimitRegistry.from_job`` could take the job's own value); proposed
upstream."""

from __future__ import annotations

import contextlib
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
with contextlib.suppress(ImportError):  # rq 2.x has none: requeue only
    RateLimit = importlib.import_module("rq.rate_limit").RateLimit

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


def plan(
    queue: Any, resource: str, enabled: bool, options: dict[str, Any], concurrency: int = 1
) -> Admission:
    """Decide how a job on ``resource`` waits; if parked, add ``rate_limit`` (RQ's
    ``RateLimit`` with ``concurrency`` runs at once: the job lock's ``limit``; and, without a
    ``job_id``, a time-sorted one) to ``options``, the enqueue call's merged RQ options."""
    own_prefix = (
        queue.job_class.redis_job_namespace_prefix != Job.redis_job_namespace_prefix
        or queue.redis_queue_namespace_prefix != Queue.redis_queue_namespace_prefix
    )
    for refused, why in (
        (not queue.is_async, Admission.SYNC),
        (not enabled, Admission.OFF),
        (not supported(), Admission.REQUEUE_ONLY),
        (options.get("rate_limit") is not None, Admission.CALLER_RATE_LIMIT),
        (bool(options.get("unique")), Admission.RQ_UNIQUE),
        (options.get("pipeline") is not None, Admission.PIPELINE),
        (own_prefix, Admission.KEY_PREFIX),
    ):
        if refused:
            return why
    key = LockKeys(conf.get().KEY_PREFIX, resource).lock  # joblock:{order:1}:lock
    options["rate_limit"] = RateLimit(key=key, concurrency=concurrency)
    options.setdefault("job_id", f"{time.time_ns():016x}{secrets.token_hex(8)}")
    return Admission.RATE_LIMIT

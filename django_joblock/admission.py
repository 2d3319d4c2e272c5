"""Admission: a job whose resource is busy waits parked in RQ, not in a requeue loop (§4.8).

On rq >= 3.0, ``@locked_job`` enqueues every job that has a lock with RQ's own
``RateLimit(key=<the lock key>, concurrency=1)``. RQ then keeps at most one job per resource
queued or running, across all queues of that Redis connection, and parks the others in the
rate limit's waiting set (status ``rate_limited``). When the admitted job ends (finished,
failed, stopped, or scheduled for a retry), RQ pushes the oldest parked job onto its queue at
once. A parked job uses no worker, no scheduler poll and none of its retry budget.

The lock inside the work horse stays the safety mechanism (TTL, heartbeat, fence, abort on
loss): admission only decides *when* a job starts, never whether two may hold the resource.
A job that finds the lock busy anyway (held by a ``lock()`` caller, a job on a queue of another
Redis, a job enqueued with ``admission=False``, an orphaned horse) requeues with backoff as
before (:mod:`django_joblock.requeue`).

Two things are added to RQ's ``RateLimit``:

- **FIFO.** RQ scores its waiting set in whole seconds and breaks ties by job id, which is
  random: two jobs enqueued within the same second would start in random order. A job that is
  parked after its enqueue gets its enqueue time (``job.created_at``, microseconds) less one
  second as score (``ZADD XX``, so a job promoted meanwhile is never put back): one second
  early, so that a job RQ parks in the same second, scored in whole seconds until its own
  ``ZADD``, can never be promoted before the jobs fixed earlier. A job that comes back from a
  requeue or an RQ retry re-enters at the back, as RQ does it.
- **Early hand-off.** A work horse running a job that was itself parked and promoted (a busy
  resource: others likely wait behind it) gives the slot to the next parked job (RQ's own
  ``release_and_enqueue``) as soon as the job's body has returned (or its replay is decided),
  instead of after its commit, its lock release and RQ's bookkeeping of the finished job. The
  next job needs a few milliseconds to be dequeued and prepared by RQ, which overlap that
  tail; a job that was parked and promoted therefore waits up to ``HANDOFF_WAIT`` for its
  lock (the job before it is releasing it) before it counts as contended (a job let through
  at its enqueue does not wait: a busy lock then has a holder outside admission). A job let
  through at its enqueue hands off in its outcome's round trip instead, after its commit and
  release (:func:`hand_off_commands`: no round trip of its own on the uncontended path). RQ's
  own release after its bookkeeping is skipped for the job either way (nothing left to
  release). Not for a body that raised: RQ fails or retries that job and releases its slot
  itself.

What frees a slot, and the bound on a waiting job when the holder's process dies (no wake-up
is lost, RQ recovers the slot):

- the job ends in its work horse: the horse releases the slot (before RQ's bookkeeping);
  when nobody was waiting, the resource's rate-limit keys go too (:func:`forget_if_idle`, in
  the round trip of the job's outcome), so RQ's set of rate-limit keys holds only resources
  with work in flight;
- the work horse is killed (SIGKILL, OOM, RQ's job timeout): the worker parent marks the job
  failed (or retried) and releases the slot at once; a horse that hangs or is stopped keeps
  the slot until RQ's job timeout kills it (its lock expired long before);
- the whole worker process dies (a ``SimpleWorker``, or a parent together with its horse): the
  job's RQ execution expires after the worker's last heartbeat, ``min(job_timeout, 30) + 60``
  s for a forking worker (RQ's ``job_monitoring_interval`` + 60) and ``job_timeout + 60`` s
  for a ``SimpleWorker`` (420 s without a timeout), and the next RQ maintenance of any
  worker on the queue marks it failed and frees the slot: bound = that expiry +
  ``--maintenance-interval``
  (``joblock_worker`` default 60 s, RQ's 600 s; :mod:`django_joblock.worker` makes idle
  workers wake up for it);
- a Redis restart keeps the waiting set and the slot (with an append-only file, as RQ needs);
  a job whose bookkeeping failed with the restart is recovered by the same maintenance, and
  one a worker popped just as Redis was killed by RQ's rule for its intermediate queue (seen
  there by a maintenance for a minute).

Not applied (``job.meta["joblock"]["admission"]`` says why; the job then requeues on
contention): rq < 3.0 (``requeue_only``), ``@locked_job(admission=False)`` (``off``), a
synchronous queue (``sync``: the job runs inline at enqueue), a caller's own ``rate_limit=``
(``caller_rate_limit``: theirs applies), RQ's ``unique=True`` (``rq_unique``: RQ refuses both),
``pipeline=`` (``pipeline``: RQ refuses rate-limited jobs in a caller's pipeline), a queue or
job class with its own key prefix (``key_prefix``: RQ refuses it).
"""

from __future__ import annotations

import enum
import importlib
import logging
from typing import Any

from rq.job import Job
from rq.queue import Queue

from . import conf, lean
from .backend import REDIS_ERRORS
from .keys import LockKeys

logger = logging.getLogger("django_joblock")

RateLimit: Any = None
RateLimitRegistry: Any = None
try:  # rq >= 3.0
    _rate_limit = importlib.import_module("rq.rate_limit")
    RateLimit, RateLimitRegistry = _rate_limit.RateLimit, _rate_limit.RateLimitRegistry
except ImportError:  # rq 2.x: requeue only
    pass

PARKED = "rate_limited"  # RQ's JobStatus.RATE_LIMITED (rq >= 3.0)
# Longest wait (s) of a job handed the resource by the job before it, for that job's lock:
# it handed off early and is still committing / releasing. Only for a job that was parked
# (a job admitted at its enqueue that finds the lock busy has a holder outside admission).
HANDOFF_WAIT = 0.5
# A job was parked when RQ pushed it onto its queue this long after creating it (a job let
# through at enqueue is pushed within milliseconds; a promoted one at its promotion).
PARKED_AFTER = 0.05


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


def _custom_prefix(queue: Any) -> bool:
    return bool(
        queue.job_class.redis_job_namespace_prefix != Job.redis_job_namespace_prefix
        or queue.redis_queue_namespace_prefix != Queue.redis_queue_namespace_prefix
    )


def plan(queue: Any, resource: str, enabled: bool, options: dict[str, Any]) -> Admission:
    """Decide how a job on ``resource`` waits, adding ``rate_limit`` to ``options`` if parked.

    ``options`` are the RQ options of the enqueue call (decoration-time and per-call merged).
    """
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
    if _custom_prefix(queue):
        return Admission.KEY_PREFIX
    assert RateLimit is not None
    options["rate_limit"] = RateLimit(key=key_for(resource), concurrency=1)
    return Admission.RATE_LIMIT


def keep_fifo(job: Any) -> None:
    """Score a job parked at enqueue by its enqueue time to the microsecond (see module docs).

    One ``ZADD XX`` on the queue's connection, only when the job was parked; a job RQ admitted
    at once costs nothing.
    """
    if RateLimitRegistry is None or job.get_status(refresh=False) != PARKED:
        return
    registry = RateLimitRegistry(key=job.rate_limit_key, connection=job.connection)
    # One second early: a job RQ parks meanwhile has a whole-second score (its enqueue second,
    # floored) until its own ZADD, and must sort after every job fixed before it. With the
    # plain enqueue time, a job fixed at 10.3 would sort after a newer job still at 10.
    score = job.created_at.timestamp() - 1
    job.connection.zadd(registry.rate_limited_key, {job.id: score}, xx=True)


def handed_on(job: Any) -> bool:
    """True when ``job`` waited parked and was pushed onto its queue by a promotion (the job
    before it on the resource handed off, or ended): RQ's ``enqueued_at`` is then its
    promotion time, well after its ``created_at``."""
    enqueued, created = getattr(job, "enqueued_at", None), getattr(job, "created_at", None)
    if enqueued is None or created is None:
        return False
    return bool((enqueued - created).total_seconds() > PARKED_AFTER)


def admitted(job: Any, resource: str | None) -> bool:
    """True when ``job`` holds an admission slot of ``resource`` (it was rate limited by us)."""
    key = getattr(job, "rate_limit_key", None)
    return resource is not None and key is not None and key == key_for(resource)


def hand_off(job: Any) -> Any:
    """Give this job's admission slot to the next parked job now (see module docs).

    Returns the resource's rate-limit registry when nobody was waiting (nobody promoted), for
    :func:`forget_if_idle` to remove its keys together with the job's last write, else None.
    Best effort: RQ releases the slot itself after its bookkeeping anyway, and its maintenance
    recovers a slot nobody released.
    """
    if RateLimitRegistry is None:
        return None
    registry = RateLimitRegistry.from_job(job)
    try:
        promoted = lean.execute(job.connection, *_release(job, registry))
    except REDIS_ERRORS:
        logger.debug("early hand-off of job %s failed; RQ releases its slot", job.id)
        return None
    handed_off(job)
    return None if promoted else registry


def hand_off_commands(job: Any) -> list[list[Any]]:
    """The commands that give this job's slot to the next parked job and, when nobody waits,
    remove the resource's rate-limit keys, for the job's outcome round trip: the hand-off of
    a job that was not itself promoted from the waiting set (see module docs). Empty on rq
    2.x. Call :func:`handed_off` once the first one ran.

    The clean-up script after the release removes nothing when the release promoted a job
    (it then holds a slot).
    """
    if RateLimitRegistry is None:
        return []
    registry = RateLimitRegistry.from_job(job)
    return [_release(job, registry), forget_if_idle(registry)]


def _release(job: Any, registry: Any) -> list[Any]:
    """RQ's own ``release_and_enqueue`` of ``job``'s slot as one command: its script, with the
    arguments RQ passes it (the concurrency from the job, which carries it: ours is always 1),
    sent by ``EVAL`` (in a batch, ``EVALSHA`` would first have to ask whether the server knows
    the script). Replies with the promoted job ids."""
    from rq.rate_limit import RELEASE_AND_ENQUEUE_SCRIPT
    from rq.utils import current_timestamp, now, utcformat

    return [
        "EVAL",
        RELEASE_AND_ENQUEUE_SCRIPT,
        2,
        registry.allowed_key,
        registry.rate_limited_key,
        job.rate_limit_concurrency or 1,
        current_timestamp(),
        utcformat(now()),
        Queue.redis_queue_namespace_prefix,
        Job.redis_job_namespace_prefix,
        job.id,
    ]


def handed_off(job: Any) -> None:
    """The slot of ``job`` was released (:func:`hand_off`, :func:`hand_off_commands`): RQ's
    own release after its bookkeeping would repeat it for nothing, so it is skipped, on this
    in-memory job only (the stored job keeps its limit, so a repeat or a requeue by RQ is rate
    limited again)."""
    job.rate_limit_key = None


def forget_if_idle(registry: Any) -> list[Any]:
    """The command that removes an idle resource's rate-limit keys (RQ's own clean-up script,
    which removes nothing while a job holds or waits for a slot), for the job's outcome round
    trip.

    Otherwise every resource ever locked would keep its config hash and its entry in RQ's
    set of rate-limit keys until RQ's maintenance, which then walks all of them (four round
    trips each): with one resource per order, that set grows by every order of the interval.
    ``EVAL`` with the script's text: ``EVALSHA`` in a batch would first have to ask the server
    whether it knows the script (one more round trip).
    """
    from rq.rate_limit import CLEANUP_REGISTRY_SCRIPT

    return [
        "EVAL",
        CLEANUP_REGISTRY_SCRIPT,
        4,
        registry.allowed_key,
        registry.rate_limited_key,
        registry.config_key,
        registry.rl_keys_key,
        registry.key,
    ]

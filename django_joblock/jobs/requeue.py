"""Contention: what a job does when its lock (or a live claim of its key) is busy.

With admission (:mod:`django_joblock.admission`) a job normally starts only when the job before
it on the resource has ended, so it finds the lock free. It finds it busy when the holder is
outside admission: a ``lock()`` caller, a job on a queue of another Redis, a job enqueued with
``admission=False`` (or on rq 2.x, where every job requeues), an orphaned horse whose worker
died. Then ``on_conflict`` decides:

- ``"requeue"``: the job returns ``rq.Retry(interval=[delay])``. RQ (>= 2.x) then schedules the
  *same job id* again after ``delay`` seconds, counting ``number_of_retries`` and leaving the
  job's own exception-retry budget (``retries_left``) untouched: contention is not a failure.
  The alternative, ``queue.enqueue_in()`` of a copy, would finish the original job as a fake
  success and give the retry a new id, breaking ``job.id`` based tracking and dependents.
  Delays are exponential with full jitter (``REQUEUE_BACKOFF``), sized by what the holder's
  lock says (read with :func:`~django_joblock.lock_info`, one round trip on this path only):
  a holder whose lock has not been renewed for more than half its TTL is not heartbeating
  (dead, paused, or heartbeat off), so the lock frees by its expiry at the latest and the
  delay is at least its remaining TTL (a dead holder is waited out in one requeue, not
  polled); a live holder's remaining TTL says nothing about when it finishes (it renews), so
  its delays follow the backoff alone (sizing them from a 30 s TTL would make a job wait
  seconds behind a holder that ends in 50 ms). Whole seconds, because RQ schedules in seconds,
  and RQ's scheduler runs them (``joblock_worker --with-scheduler``). An admitted job
  that requeues gives its admission slot up (RQ releases it when the job is scheduled) and
  re-enters the waiting line at the back when its delay is over. After ``max_wait`` (default
  ``REQUEUE_MAX_WAIT``) seconds of contention the job raises :class:`LockContentionTimeout`
  and ends *failed*, visible in RQ's failed registry with the reason: a valid job is never
  silently dropped.
  A ``"requeue"`` job whose acquire finds the lock's Redis unavailable
  (:class:`LockBackendUnavailable`) is requeued the same way (:func:`unavailable`).
- ``"skip"``: finish without running (``job.meta["joblock"]["outcome"] = "skipped"``).
- ``"fail"``: raise :class:`LockNotAcquired` (or :class:`IdempotencyInProgress`, or
  :class:`ResourceInTransaction`).

A run that cannot be requeued (an inline call, or a synchronous queue: no worker would run the
requeued job) treats ``"requeue"`` like ``lock()``: it has already waited up to
``ACQUIRE_WAIT`` for the lock and raises :class:`LockNotAcquired`.
"""

from __future__ import annotations

import math
import time
from typing import Any

from rq import Retry

from .. import conf, metrics
from ..backoff import full_jitter
from ..exceptions import (
    IdempotencyInProgress,
    LockBackendUnavailable,
    LockContentionTimeout,
    LockNotAcquired,
    ResourceInTransaction,
)
from ..locks.info import LockInfo, lock_info
from ..locks.lock import Lock
from ..signals import job_requeued
from .outcomes import JobOutcome, Run
from .spec import JobSpec, OnConflict

# RQ fails a job that returned Retry more than ``max`` times; we give up by time instead.
RETRY_MAX = 10**6
_MAX_DELAYS_KEPT = 50
# Slack (s) on "not renewed for half its TTL": a renewal in flight, clocks of the reads.
STALE_MARGIN = 0.25

Ending = tuple[JobOutcome, Any, dict[str, Any]]


Busy = IdempotencyInProgress | ResourceInTransaction


def conflict(run: Run, held: Lock | None, in_progress: Busy | None) -> Ending:
    """Apply ``on_conflict`` to a busy lock (``held``, not acquired), a live claim, or a
    resource whose previous holder is still inside its transaction (``in_progress``)."""
    return _handle(run, held, in_progress)  # its counts: flushed by the runner at the end


def unavailable(run: Run, held: Lock, exc: LockBackendUnavailable) -> Ending:
    """The lock's Redis did not answer the acquire of a worker's ``on_conflict="requeue"`` job:
    requeue it with backoff as for a busy lock (the job has not started; nothing ran).

    Failing it instead would fail a whole parked backlog within seconds of a short outage:
    each failed job frees its admission slot and RQ promotes the next one at once. Bounded
    like contention (``max_wait``, then :class:`LockContentionTimeout`); ``"skip"`` and
    ``"fail"`` jobs, and inline calls, raise :class:`LockBackendUnavailable` as before.
    """
    return _requeue(run, held, f"the lock's Redis did not answer ({exc})", None)


def _holder(held: Lock | None) -> LockInfo | None:
    if held is None:
        return None
    try:
        return lock_info(held.resource, using=held.alias)
    except LockBackendUnavailable:
        return None  # the acquire just answered; if Redis went away now, RQ retries anyway


def describe(info: LockInfo | None) -> str:
    """``host:pid owner=<hash> job=<id>`` of a holder (for logs and reasons)."""
    if info is None:
        return ""
    text = f"{info.host}:{info.pid} owner={info.owner}"
    if info.job_id:
        text += f" job={info.job_id}"
    return f"{text} ({info.expires_in:.1f}s of TTL left)"


def _handle(run: Run, held: Lock | None, in_progress: Busy | None) -> Ending:
    spec = run.spec
    # A live claim, or an open transaction, under our own lock: the lock is ours; the key, or
    # the resource's rows, are still someone else's.
    info = _holder(held) if in_progress is None else None
    run.holder = describe(info)
    twin: str | None = None
    if in_progress is not None:
        what = str(in_progress)
    else:
        assert held is not None
        what = f"lock {held.resource!r} is busy"
        twin = in_flight(run, info)
        if twin is not None:
            # The queue delivered this work twice and the first delivery still runs: not a
            # contention problem (the article's first debugging question). It waits as any
            # contended job does, then its key replays the first one's result.
            metrics.count("duplicates_in_flight", run.family, spec.name)
            what = f"a duplicate in flight: key {run.key!r} is running as job {twin}"
    if spec.on_conflict is OnConflict.SKIP:
        metrics.count("skipped", run.family, spec.name)
        return JobOutcome.SKIPPED, None, {"reason": what}
    if spec.on_conflict is OnConflict.FAIL or not run.worker:
        if in_progress is not None:
            raise in_progress
        assert held is not None
        suffix = (
            ""
            if spec.on_conflict is OnConflict.FAIL
            else " (a run without a worker cannot requeue)"
        )
        holder = f"; held by {run.holder}" if run.holder else ""
        raise LockNotAcquired(
            f"{spec.name}: lock busy{suffix}{holder}", resource=held.resource, key=held.key
        )
    ending = _requeue(run, held, what, info)
    if twin is not None:
        ending[2]["duplicate_of"] = twin
    return ending


def in_flight(run: Run, info: LockInfo | None) -> str | None:
    """The RQ job id of the lock's holder when it runs this run's very idempotency key (a
    second delivery of the same work while the first still runs), else None.

    Read only on contention, from the holder's RQ job (its function and arguments give its
    key), on this job's queue connection; a holder that is not an RQ job of the same function,
    or cannot be read, is never called a duplicate.
    """
    job = run.job
    if info is None or not info.job_id or run.key is None or job is None:
        return None
    if info.job_func != run.spec.name or info.job_id == job.id:
        return None
    try:
        holder = job.__class__.fetch(info.job_id, connection=job.connection)
        key = run.spec.key(run.spec.bind(tuple(holder.args), dict(holder.kwargs)))
    except Exception:  # noqa: BLE001 - gone, unreadable, other arguments: not evidence
        return None
    return info.job_id if key == run.key else None


def stale(info: LockInfo | None) -> bool:
    """True when the holder's lock was not renewed for more than half its TTL: no heartbeat
    runs for it (renewals come every TTL/3, at most TTL/2), so it frees by its expiry."""
    if info is None or info.ttl <= 0:
        return False
    return info.ttl - info.expires_in > info.ttl / 2 + STALE_MARGIN


def delay_for(attempt: int, info: LockInfo | None, limit_left: float) -> int:
    """Seconds until the next try of a requeued job (whole, >= 1, never far past the limit);
    see the module docs. ``info``: the holder's lock, if known."""
    backoff = conf.get().REQUEUE_BACKOFF
    delay = full_jitter(
        attempt, base=backoff["base"], factor=backoff["factor"], max_delay=backoff["max"]
    )
    if info is not None and stale(info):
        delay = max(delay, info.expires_in)  # free by then at the latest
    # RQ schedules in whole seconds (>= 1, as 0 would mean "now").
    return int(min(max(1, math.ceil(delay)), max(1, math.ceil(limit_left))))


def _requeue(run: Run, held: Lock | None, what: str, info: LockInfo | None) -> Ending:
    spec, job = run.spec, run.job
    settings = conf.get()
    state = job.meta.setdefault("joblock", {})
    now = time.time()
    first = float(state.setdefault("first_contended", now))
    attempt = int(state.get("requeues", 0))
    limit = spec.max_wait if spec.max_wait is not None else settings.REQUEUE_MAX_WAIT
    waited = now - first
    resource = held.resource if held is not None else None
    key = held.key if held is not None else None
    if waited >= limit:
        metrics.count("given_up", run.family, spec.name)
        raise LockContentionTimeout(
            f"{spec.name}: gave up after {waited:.0f}s and {attempt} requeues waiting "
            f"({what}); REQUEUE_MAX_WAIT/max_wait is {limit:g}s",
            resource=resource,
            key=key,
        )
    seconds = delay_for(attempt, info, limit - waited)
    delays = [*state.get("delays", []), seconds][-_MAX_DELAYS_KEPT:]
    metrics.count("requeued", run.family, spec.name)
    job_requeued.send(sender=JobSpec, job=job, lock=held, delay=seconds)
    extra = {"requeues": attempt + 1, "delays": delays, "reason": what}
    return JobOutcome.REQUEUED, Retry(max=RETRY_MAX, interval=[seconds]), extra

"""Contention (docs/jobs.md, "Conflicts"): what a job does when its lock, a live claim of its key or
its resource's transaction guard is busy. ``"requeue"`` returns ``rq.Retry`` for the *same job id*
after whole seconds of jittered backoff (at least the remaining TTL of a holder that stopped
renewing; no retry budget spent), also when the lock's Redis does not answer, and after ``max_wait``
raises :class:`LockContentionTimeout`: the job fails, visibly. ``"skip"`` finishes without running;
``"fail"``, and ``"requeue"`` in a run that cannot requeue (inline, a synchronous queue), raise
:class:`LockNotAcquired` (or the claim's or guard's exception)."""

from __future__ import annotations

import contextlib
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

RETRY_MAX = 10**6  # RQ fails a job that returned Retry more than max times; we give up by time
_MAX_DELAYS_KEPT = 50
STALE_MARGIN = 0.25  # slack (s) on "not renewed for half its TTL": renewals in flight, clocks

Ending = tuple[JobOutcome, Any, dict[str, Any]]


def conflict(
    run: Run, held: Lock | None, in_progress: IdempotencyInProgress | ResourceInTransaction | None
) -> Ending:
    """Apply ``on_conflict`` to a busy lock (``held``, not acquired) or to ``in_progress``: a
    live claim of the key, or the resource's guard still taken (counts flushed by the runner)."""
    spec = run.spec
    info: LockInfo | None = None
    twin: str | None = None
    if in_progress is not None:
        what = str(in_progress)
    else:
        assert held is not None
        with contextlib.suppress(LockBackendUnavailable):  # gone since the acquire: no info
            info = lock_info(held.resource, cache=held.cache)
        if info is not None:  # for the log line and the reason
            job = f" job={info.job_id}" if info.job_id else ""
            run.holder = (
                f"{info.host}:{info.pid} owner={info.owner}{job} "
                f"({info.expires_in:.1f}s of TTL left)"
            )
        what = f"lock {held.resource!r} is busy"
        twin = in_flight(run, info)
        if twin is not None:
            # Delivered twice, the first still running: wait as contended, then replay its result.
            metrics.count("duplicates_in_flight", run.family, spec.name)
            what = f"a duplicate in flight: key {run.key!r} is running as job {twin}"
    if spec.on_conflict is OnConflict.SKIP:
        metrics.count("skipped", run.family, spec.name)
        return JobOutcome.SKIPPED, None, {"reason": what}
    fail = spec.on_conflict is OnConflict.FAIL
    if fail or not run.worker:
        if in_progress is not None:
            raise in_progress
        assert held is not None
        why = "" if fail else " (a run without a worker cannot requeue)"
        holder = f"; held by {run.holder}" if run.holder else ""
        message = f"{spec.name}: lock busy{why}{holder}"
        raise LockNotAcquired(message, resource=held.resource, key=held.key)
    ending = requeue(run, held, what, info)
    if twin is not None:
        ending[2]["duplicate_of"] = twin
    return ending


def in_flight(run: Run, info: LockInfo | None) -> str | None:
    """The holder's RQ job id when it runs this very idempotency key (a second delivery still
    running), else None; a holder that is no RQ job of this function, or unreadable, is not."""
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


def delay_for(attempt: int, info: LockInfo | None, limit_left: float) -> int:
    """Seconds until the next try of a requeued job: whole (RQ schedules in seconds), >= 1,
    never far past the limit; ``info``: the holder's lock, if known (see the module docs)."""
    curve = conf.get().REQUEUE_BACKOFF
    delay = full_jitter(attempt, base=curve["base"], factor=curve["factor"], max_delay=curve["max"])
    # Not renewed for over half its TTL (renewals come every TTL/3): free by its expiry.
    if info and info.ttl > 0 and info.ttl - info.expires_in > info.ttl / 2 + STALE_MARGIN:
        delay = max(delay, info.expires_in)
    return int(min(max(1, math.ceil(delay)), max(1, math.ceil(limit_left))))


def requeue(run: Run, held: Lock | None, what: str, info: LockInfo | None) -> Ending:
    """Requeue a worker's job busy because of ``what``, or give up after ``max_wait``."""
    spec = run.spec
    job = run.job
    state = job.meta.setdefault("joblock", {})
    now = time.time()
    first = float(state.setdefault("first_contended", now))
    attempt = int(state.get("requeues", 0))
    limit = spec.max_wait if spec.max_wait is not None else conf.get().REQUEUE_MAX_WAIT
    waited = now - first
    if waited >= limit:
        metrics.count("given_up", run.family, spec.name)
        message = (
            f"{spec.name}: gave up after {waited:.0f}s and {attempt} requeues waiting "
            f"({what}); REQUEUE_MAX_WAIT/max_wait is {limit:g}s"
        )
        raise LockContentionTimeout(
            message,
            resource=held.resource if held is not None else None,
            key=held.key if held is not None else None,
        )
    seconds = delay_for(attempt, info, limit - waited)
    delays = [*state.get("delays", []), seconds][-_MAX_DELAYS_KEPT:]
    metrics.count("requeued", run.family, spec.name)
    job_requeued.send(sender=JobSpec, job=job, lock=held, delay=seconds)
    extra = {"requeues": attempt + 1, "delays": delays, "reason": what}
    return JobOutcome.REQUEUED, Retry(max=RETRY_MAX, interval=[seconds]), extra

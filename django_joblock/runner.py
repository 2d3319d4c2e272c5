"""The order of work inside the work horse, from the design article:

1. acquire the lock on the *resource* (not the job id) -> the renewal thread heartbeats it;
2. claim the idempotency key -> if an earlier run succeeded, return its stored result;
3. run the function inside ``transaction.atomic()`` and record success **in that same
   transaction** as its effect, committing only if the lock is still held (``ensure_held()``).
   A job with a lock and no idempotency key runs the same way, so a lost lock rolls its
   writes back too (unless declared ``atomic=False``); the transaction is on the database the
   idempotency records use;
4. return (RQ acknowledges the job), release the lock if still ours.

A busy lock (or a claim still running elsewhere) is a *conflict*, handled by ``on_conflict``:

- ``"requeue"``: the job returns ``rq.Retry(interval=[delay])``. RQ (>= 2.x) then schedules the
  *same job id* again after ``delay`` seconds, counting ``number_of_retries`` and leaving the
  job's own exception-retry budget (``retries_left``) untouched: contention is not a failure.
  The alternative, ``queue.enqueue_in()`` of a copy, would finish the original job as a fake
  success and give the retry a new id, breaking ``job.id`` based tracking and dependents.
  Delays are exponential with full jitter (``REQUEUE_BACKOFF``), in whole seconds because RQ
  schedules in seconds, and need RQ's scheduler (``joblock_worker --with-scheduler``). After
  ``max_wait`` (default ``REQUEUE_MAX_WAIT``) seconds of contention the job raises
  :class:`LockContentionTimeout` and ends *failed*, visible in RQ's failed registry with the
  reason: a valid job is never silently dropped.
- ``"skip"``: finish without running (logged; ``job.meta["joblock"]["outcome"] = "skipped"``).
- ``"fail"``: raise :class:`LockNotAcquired` (or :class:`IdempotencyInProgress`).

Called inline (not by a worker running this job), ``"requeue"`` cannot requeue: it waits up to
``ACQUIRE_WAIT`` seconds like ``lock()`` and then raises :class:`LockNotAcquired`.

Every run by a worker ends with ``job.meta["joblock"]["outcome"]`` set to one of
:class:`JobOutcome` (``ran``, ``replayed``, ``requeued``, ``skipped``, ``failed``, ``gave_up``,
``aborted``) and, except for ``ran`` / ``replayed``, a ``reason``. RQ never saves ``meta`` when
it finishes a job, so this is one ``HSET`` on the queue's connection per job; it is written
after the job's transaction committed and outside the abort window, and a failure to write it
is logged, never turned into a job failure.

A job aborted because an operator released its lock (admin force release, ``joblock_release``,
``joblock_reap``) raises ``LockLost`` saying so, with the audit id (see
:mod:`django_joblock.tombstones`), instead of "expired".
"""

from __future__ import annotations

import contextlib
import enum
import math
import time
from typing import Any

from django.db import router, transaction
from rq import Retry, get_current_job

from . import conf, metrics, tombstones
from .abort import Abort
from .backend import REDIS_ERRORS, connection, renewal_client
from .backoff import full_jitter
from .exceptions import (
    IdempotencyInProgress,
    LockBackendUnavailable,
    LockContentionTimeout,
    LockLost,
    LockNotAcquired,
)
from .idempotency import fingerprint_of, idempotent
from .jobs import JobSpec
from .keys import family
from .locks import Lock, reset_current_lock, set_current_lock
from .logs import log_lock, logger
from .signals import job_requeued

# RQ fails a job that returned Retry more than ``max`` times; we give up by time instead.
_RETRY_MAX = 10**6
_MAX_DELAYS_KEPT = 50
# Reading the operator's note on the loss path: never wait long for a Redis that may be gone.
_NOTE_TIMEOUT = 1.0
_AUDIT_ID_WAIT = 2.0


class JobOutcome(enum.StrEnum):
    """``job.meta["joblock"]["outcome"]`` after a run by a worker."""

    RAN = "ran"  # the function ran and its effect committed
    REPLAYED = "replayed"  # an earlier run succeeded: its stored result was returned
    REQUEUED = "requeued"  # busy: RQ runs the same job again after a delay
    SKIPPED = "skipped"  # busy, on_conflict="skip": finished without running
    FAILED = "failed"  # raised: on_conflict="fail", or the function (or RQ's timeout) raised
    GAVE_UP = "gave_up"  # busy for longer than max_wait: LockContentionTimeout
    ABORTED = "aborted"  # the lock was lost while running: LockLost, effect rolled back


Ending = tuple[JobOutcome, Any, dict[str, Any]]


def run(spec: JobSpec[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``spec.func(*args, **kwargs)`` under the safe flow (see the module docs)."""
    arguments = spec.bind(args, kwargs)
    resource = spec.resource(arguments)
    key = spec.key(arguments)
    job = _own_job(spec)
    try:
        outcome, result, extra = _flow(spec, resource, key, arguments, args, kwargs, job)
    except Exception as exc:
        _mark(job, _failure(exc), reason=f"{type(exc).__name__}: {exc}")
        raise
    _mark(job, outcome, **extra)
    return result


def _failure(exc: BaseException) -> JobOutcome:
    if isinstance(exc, LockContentionTimeout):
        return JobOutcome.GAVE_UP
    if isinstance(exc, LockLost):
        return JobOutcome.ABORTED
    return JobOutcome.FAILED


def _flow(
    spec: JobSpec[Any, Any],
    resource: str | None,
    key: str | None,
    arguments: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    job: Any,
) -> Ending:
    if resource is None:
        try:
            return _claim_and_run(spec, key, arguments, args, kwargs, None, job)
        except IdempotencyInProgress as exc:
            return _conflict(spec, job, None, exc)
    abort = Abort()
    held = Lock(
        resource,
        ttl=spec.ttl,
        heartbeat=spec.heartbeat,
        on_lost=lambda lock, reason: _lost(spec, abort, lock, reason),
    )
    if not held.acquire(wait=0.0 if job is not None else None):
        return _conflict(spec, job, held, None)
    token = set_current_lock(held)
    try:
        armed = abort if conf.get().ON_LOCK_LOST == "abort" else contextlib.nullcontext()
        try:
            with armed:
                return _claim_and_run(spec, key, arguments, args, kwargs, held, job)
        except LockLost as exc:
            note = _operator_note(held)
            if note is None:
                raise
            raise LockLost(
                f"Job aborted: its lock was {note.describe()}",
                resource=held.resource,
                key=held.key,
                owner=held.owner,
            ) from exc
    except IdempotencyInProgress as exc:
        return _conflict(spec, job, held, exc)
    finally:
        reset_current_lock(token)
        try:
            held.release()
        except LockBackendUnavailable:
            logger.warning(
                "could not release %s after the job; it expires after its TTL",
                held.key,
                exc_info=True,
            )


def _own_job(spec: JobSpec[Any, Any]) -> Any:
    """The RQ job running *this* function in this worker, or None (inline call)."""
    job = get_current_job()
    return job if job is not None and job.func_name == spec.name else None


def _lost(spec: JobSpec[Any, Any], abort: Abort, held: Lock, reason: str) -> None:
    abort.lost(held, reason)
    if spec.on_lost is not None:
        spec.on_lost(held, reason)


def _operator_note(held: Lock) -> tombstones.OperatorRelease | None:
    """Did an operator release this holding? Read in the job's thread, on the loss path only.

    One GET normally. A note still without its audit id (the operator's process writes the
    audit row right after the release, and on SQLite it waits for this job's transaction to
    end) is read again for up to ``_AUDIT_ID_WAIT`` seconds: the job is failing anyway.
    """
    client = None
    try:
        client = renewal_client(connection(held.alias), _NOTE_TIMEOUT)
        prefix = conf.get().KEY_PREFIX
        note = tombstones.read(client, prefix, held.resource, held.owner)
        deadline = time.monotonic() + _AUDIT_ID_WAIT
        while note is not None and note.audit is None and time.monotonic() < deadline:
            time.sleep(0.05)
            note = tombstones.read(client, prefix, held.resource, held.owner) or note
        return note
    except REDIS_ERRORS:
        return None  # Redis is gone too: the plain loss reason stands
    finally:
        if client is not None:
            client.connection_pool.disconnect()


def _fingerprint(arguments: dict[str, Any]) -> str:
    try:
        return fingerprint_of(arguments)
    except TypeError:  # arguments RQ can pickle but JSON cannot: fall back to their repr
        return fingerprint_of(repr(sorted(arguments.items())))


def _database() -> str:
    from .models import IdempotencyRecord

    return str(router.db_for_write(IdempotencyRecord))


def _claim_and_run(
    spec: JobSpec[Any, Any],
    key: str | None,
    arguments: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    held: Lock | None,
    job: Any,
) -> Ending:
    if key is None and not spec.atomic:
        return JobOutcome.RAN, spec.func(*args, **kwargs), {}  # its own transactions: fenced
    if key is None:
        # A lock-only job: same transaction rule as the others, so a lost lock rolls back.
        with transaction.atomic(using=_database()):
            result = spec.func(*args, **kwargs)
            if held is not None:
                held.ensure_held()  # never commit the effect of a job that lost its lock
        return JobOutcome.RAN, result, {}
    with idempotent(key, scope=spec.scope, fingerprint=_fingerprint(arguments)) as claim:
        if claim.done:
            logger.info(
                "duplicate blocked: %s already done",
                key,
                extra={
                    "job_id": getattr(job, "id", None),
                    "outcome": "replayed",
                    "reason": f"idempotency key {key!r} succeeded before",
                },
            )
            return JobOutcome.REPLAYED, claim.result, {}
        with transaction.atomic(using=claim.using):
            result = spec.func(*args, **kwargs)
            if held is not None:
                held.ensure_held()  # never commit the effect of a job that lost its lock
            claim.succeed(result)
        return JobOutcome.RAN, result, {}


def _mark(job: Any, outcome: JobOutcome, **extra: Any) -> None:
    """Write ``outcome`` (and ``extra``) to ``job.meta["joblock"]``: one HSET, best effort."""
    if job is None:
        return
    state = job.meta.setdefault("joblock", {})
    state["outcome"] = outcome.value
    if "reason" not in extra:
        state.pop("reason", None)  # a reason from an earlier requeue no longer applies
    state.update(extra)
    try:
        job.save_meta()
    except REDIS_ERRORS:
        logger.warning(
            "could not record outcome %s in the meta of job %s",
            outcome.value,
            job.id,
            exc_info=True,
            extra={"job_id": job.id, "outcome": outcome.value},
        )


def _conflict(
    spec: JobSpec[Any, Any], job: Any, held: Lock | None, in_progress: IdempotencyInProgress | None
) -> Ending:
    try:
        return _handle_conflict(spec, job, held, in_progress)
    finally:
        if job is not None:
            metrics.flush_now()  # the work horse may exit right after this job


def _family(held: Lock | None, in_progress: IdempotencyInProgress | None) -> str:
    if held is not None:
        return held.family
    return family(getattr(in_progress, "key", "") or "")


def _handle_conflict(
    spec: JobSpec[Any, Any], job: Any, held: Lock | None, in_progress: IdempotencyInProgress | None
) -> Ending:
    what = f"lock {held.resource!r} is busy" if held is not None else str(in_progress)
    if spec.on_conflict == "skip":
        metrics.count("skipped", _family(held, in_progress), spec.name)
        logger.info(
            "skipped %s: %s",
            spec.name,
            what,
            extra={"job_id": getattr(job, "id", None), "outcome": "skipped", "reason": what},
        )
        return JobOutcome.SKIPPED, None, {"reason": what}
    if spec.on_conflict == "fail" or job is None:
        if in_progress is not None:
            raise in_progress
        assert held is not None
        suffix = "" if spec.on_conflict == "fail" else " (inline calls cannot be requeued)"
        raise LockNotAcquired(
            f"{spec.name}: lock busy{suffix}", resource=held.resource, key=held.key
        )
    return _requeue(spec, job, held, what, _family(held, in_progress))


def _requeue(spec: JobSpec[Any, Any], job: Any, held: Lock | None, what: str, fam: str) -> Ending:
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
        metrics.count("given_up", fam, spec.name)
        raise LockContentionTimeout(
            f"{spec.name}: gave up after {waited:.0f}s and {attempt} requeues waiting "
            f"({what}); REQUEUE_MAX_WAIT/max_wait is {limit:g}s",
            resource=resource,
            key=key,
        )
    backoff = settings.REQUEUE_BACKOFF
    delay = full_jitter(attempt, base=backoff["base"], factor=backoff["factor"], cap=backoff["max"])
    # RQ schedules in whole seconds (>= 1, as 0 would mean "now"); never far past the limit.
    seconds = min(max(1, math.ceil(delay)), max(1, math.ceil(limit - waited)))
    delays = [*state.get("delays", []), seconds][-_MAX_DELAYS_KEPT:]
    metrics.count("requeued", fam, spec.name)
    job_requeued.send(sender=JobSpec, job=job, lock=held, delay=seconds)
    if held is not None:
        log_lock(
            20,
            "requeued",
            held,
            f"{spec.name} requeued in {seconds}s",
            reason=f"{what}; attempt {attempt + 1}",
        )
    else:
        logger.info(
            "requeued %s in %ss: %s",
            spec.name,
            seconds,
            what,
            extra={"job_id": job.id, "outcome": "requeued", "reason": what},
        )
    extra = {"requeues": attempt + 1, "delays": delays, "reason": what}
    return JobOutcome.REQUEUED, Retry(max=_RETRY_MAX, interval=[seconds]), extra

"""The order of work inside the work horse, from the design article:

1. acquire the lock on the *resource* (not the job id) -> the renewal thread heartbeats it;
2. claim the idempotency key -> if an earlier run succeeded, return its stored result;
3. run the function inside ``transaction.atomic()`` and record success **in that same
   transaction** as its effect; just before the commit, ``ensure_held()`` rolls everything
   back if the lock is no longer held (a loss in the instant between that check and the
   commit is what the fence and the record's unique key are for);
4. return (RQ acknowledges the job) and release the lock if still ours; RQ then hands the
   resource's admission slot to the next parked job (:mod:`.admission`).

**One commit per job** (§4.9). Under a held lock, steps 2 and 3 are one transaction: the claim
row is inserted (or taken over) by the transaction's first statements, the effect follows, the
success record last, and everything commits once. A crash rolls the claim back with the
effect, so no claim is left behind to lease out; a concurrent run of the same key (possible
only after a lock loss) does not wait for it but is "in progress" at once on PostgreSQL (the
key's transaction-scoped guard, :mod:`django_joblock.idempotency_store`), after at most the
busy timeout on SQLite; its ``on_conflict`` applies. Of two runs, at most one commits (the
record's unique key). A replay is one query. A run that raised leaves a ``failed`` record
(written after the rollback, in its own transaction). Without a lock, the claim commits on
its own first, as before: that separate claim is what keeps two concurrent duplicates from
both running non-database side effects. A job with a lock and no idempotency key follows the
same transaction rule (unless declared ``atomic=False``), so a lost lock rolls its writes back
too. The transaction is on the database the idempotency records use. Under a held lock it
takes the resource's transaction guard (:mod:`django_joblock.idempotency.guard`, PostgreSQL:
in the claim statement, or right before a lock-only job's first query: a lock-only job whose
body never queries sends no statement at all), so a run never reads the resource's rows while
a previous holder that lost the lock is still inside its transaction; one that finds it taken
raises :class:`ResourceInTransaction` (a run without a worker first waits up to
``ACQUIRE_WAIT`` for it), its transaction rolls back, and its ``on_conflict`` applies.

Contention is handled by :mod:`.requeue`; outcomes, the one log line per run and the
wait-to-start metric by :mod:`.outcomes`.

Called inline (not by a worker running this job), or by a synchronous queue (``is_async=False``,
where no worker would run a requeued job), a busy lock is waited for up to ``ACQUIRE_WAIT``
seconds like ``lock()``, then ``on_conflict`` applies with ``"requeue"`` raising
:class:`LockNotAcquired`: such a job never "finishes" without running.

A job aborted because an operator released its lock (admin force release, ``joblock_release``,
``joblock_reap``) raises ``LockLost`` saying so, with the audit id (see
:mod:`django_joblock.locks.notes`), instead of "expired".
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from django.db import DatabaseError, router, transaction
from rq import get_current_job

from .. import conf, metrics
from ..backend import REDIS_ERRORS, client
from ..exceptions import (
    IdempotencyInProgress,
    LockBackendUnavailable,
    LockContentionTimeout,
    LockLost,
    ResourceInTransaction,
)
from ..idempotency import guard
from ..idempotency.claims import Idempotent, fingerprint_of, idempotent
from ..idempotency.one_commit import claim_in_transaction, record_failure, record_result
from ..locks import notes
from ..locks.lock import Lock, reset_current_lock, set_current_lock
from ..logs import logger
from .abort import Abort
from .outcomes import JobOutcome, Run, finish
from .requeue import Ending, conflict, unavailable
from .spec import JobSpec, OnConflict

__all__ = ["JobOutcome", "run"]

# Reading the operator's note on the loss path: never wait long for a Redis that may be gone.
_NOTE_TIMEOUT = 1.0
_AUDIT_ID_WAIT = 2.0


def run(spec: JobSpec[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``spec.func(*args, **kwargs)`` under the safe flow (see the module docs)."""
    arguments = spec.bind(args, kwargs)
    job = _own_job(spec)
    state = Run(
        spec,
        spec.resource(arguments),
        spec.key(arguments),
        job,
        worker=job is not None and getattr(job, "worker_name", None) != "sync",
    )
    try:
        try:
            outcome, result, extra = _flow(state, arguments, args, kwargs)
        except Exception as exc:
            finish(state, _failure(exc), reason=f"{type(exc).__name__}: {exc}")
            raise
        finish(state, outcome, **extra)
        return result
    finally:
        state.note_duration()
        # Whatever this run counted and no lock release carried (a job without a lock, a
        # replay, contention, a loss): the work horse may os._exit right after.
        metrics.flush_now()


def _failure(exc: BaseException) -> JobOutcome:
    if isinstance(exc, LockContentionTimeout):
        return JobOutcome.GAVE_UP
    if isinstance(exc, LockLost):
        return JobOutcome.ABORTED
    return JobOutcome.FAILED


def _flow(
    state: Run, arguments: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Ending:
    spec = state.spec
    if state.resource is None:
        state.started()
        try:
            return _claim_and_run(state, arguments, args, kwargs, None)
        except IdempotencyInProgress as exc:
            return conflict(state, None, exc)
    abort = Abort()
    held = Lock(
        state.resource,
        ttl=spec.ttl,
        heartbeat=spec.heartbeat,
        on_lost=lambda lock, reason: _lost(spec, abort, lock, reason),
    )
    try:  # a worker tries once (admission let it start); an inline call waits ACQUIRE_WAIT
        acquired = held.acquire(wait=0.0 if state.worker else None)
    except LockBackendUnavailable as exc:
        if not state.worker or spec.on_conflict is not OnConflict.REQUEUE:
            raise
        return unavailable(state, held, exc)
    if not acquired:
        return conflict(state, held, None)
    state.started()
    token = set_current_lock(held)
    try:
        armed = abort if conf.get().ON_LOCK_LOST == "abort" else contextlib.nullcontext()
        try:
            with armed:
                return _claim_and_run(state, arguments, args, kwargs, held)
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
    except (IdempotencyInProgress, ResourceInTransaction) as exc:
        return conflict(state, held, exc)
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


def _operator_note(held: Lock) -> notes.OperatorRelease | None:
    """Did an operator release this holding? Read in the job's thread, on the loss path only.

    One GET normally. A note still without its audit id (the operator's process writes the
    audit row right after the release, and on SQLite it waits for this job's transaction to
    end) is read again for up to ``_AUDIT_ID_WAIT`` seconds: the job is failing anyway.
    """
    try:
        found = client(held.alias, _NOTE_TIMEOUT)
        note = notes.read(found, held.keys.released, held.owner)
        deadline = time.monotonic() + _AUDIT_ID_WAIT
        while note is not None and note.audit is None and time.monotonic() < deadline:
            time.sleep(0.05)
            note = notes.read(found, held.keys.released, held.owner) or note
        return note
    except REDIS_ERRORS:
        return None  # Redis is gone too: the plain loss reason stands


def _database() -> str:
    from ..models import IdempotencyRecord

    return str(router.db_for_write(IdempotencyRecord))


def _guard_wait(state: Run) -> float:
    """How long a run waits for its resource's transaction guard: a worker's run not at all
    (it requeues), a run without a worker up to ``ACQUIRE_WAIT``, as for the lock."""
    return 0.0 if state.worker else conf.get().ACQUIRE_WAIT


def _claim_and_run(
    state: Run,
    arguments: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    held: Lock | None,
) -> Ending:
    spec, key = state.spec, state.key
    if key is None and not spec.atomic:
        return JobOutcome.RAN, spec.func(*args, **kwargs), {}  # its own transactions: fenced
    if key is None:
        # A lock-only job: same transaction rule as the others, so a lost lock rolls back; the
        # guard is taken before its first query, so a body that never queries sends nothing.
        using = _database()
        with transaction.atomic(using=using):
            with guard.before_first_query(using, held, wait=_guard_wait(state)):
                result = spec.func(*args, **kwargs)
            if held is not None:
                held.ensure_held()  # never commit the effect of a job that lost its lock
        return JobOutcome.RAN, result, {}
    claim_spec = idempotent(
        key, scope=spec.scope, fingerprint=fingerprint_of(arguments), using=_database()
    )
    if held is not None:
        return _one_commit(state, claim_spec, args, kwargs, held)
    with claim_spec as claim:  # no lock: the claim commits on its own first (module docs)
        if claim.done:
            return JobOutcome.REPLAYED, claim.result, {}
        with transaction.atomic(using=claim.using):
            result = spec.func(*args, **kwargs)
            claim.succeed(result)
        return JobOutcome.RAN, result, {}


def _one_commit(
    state: Run, claim_spec: Idempotent, args: tuple[Any, ...], kwargs: dict[str, Any], held: Lock
) -> Ending:
    """Claim, effect and success record in one transaction (see the module docs)."""
    spec = state.spec
    claimed = False
    try:
        with transaction.atomic(using=claim_spec.using):
            if not state.worker:  # it waits for the guard too; the claim then has it at once
                guard.take(claim_spec.using, held, wait=_guard_wait(state))
            claim = claim_in_transaction(claim_spec, held)
            claimed = True
            if claim.done:
                return JobOutcome.REPLAYED, claim.result, {}
            result = spec.func(*args, **kwargs)
            held.ensure_held()  # never commit the effect of a job that lost its lock
            record_result(claim, result)
        return JobOutcome.RAN, result, {}
    except IdempotencyInProgress:
        raise
    except DatabaseError as exc:
        if not claimed and "locked" in str(exc):
            # SQLite: another transaction kept the database's write lock past the busy
            # timeout before this run could claim (BEGIN IMMEDIATE waits for it).
            raise IdempotencyInProgress(
                f"Idempotency key {claim_spec.key!r}: the database stayed locked by another "
                f"transaction ({exc}); treated as in progress.",
                key=claim_spec.key,
                scope=claim_spec.scope,
            ) from exc
        if claimed:
            record_failure(claim_spec, f"{type(exc).__name__}: {exc}")
        raise
    except LockLost:
        raise  # the lock is someone else's now, and so is the key: leave its record alone
    except BaseException as exc:
        if claimed:
            record_failure(claim_spec, f"{type(exc).__name__}: {exc}")
        raise

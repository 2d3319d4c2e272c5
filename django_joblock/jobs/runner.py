"""The flow of one ``@locked_job`` run, in the work horse or inline (docs/jobs.md, "The flow"):
acquire the lock on the *resource* (heartbeated), claim the idempotency key (an earlier success
replays), run the function, ``ensure_held()`` and record the success in one transaction, then
release the lock if still ours. Under a lock, claim, effect and record **commit once**, so a crash
leaves no claim behind and of two runs of one key (after a lock loss) at most one commits; without a
lock the claim commits first, so duplicates never both run. A locked run first takes the resource's
transaction guard (:mod:`django_joblock.idempotency.resource_guard`): it never reads rows a
holder that lost the lock still writes; a worker's run waits for it up to the lock's TTL,
ending a paused previous holder's transaction meanwhile. Inline or on a synchronous queue, lock
and guard are waited for up to ``ACQUIRE_WAIT``. An operator's release is named in ``LockLost``."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
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
from ..idempotency import resource_guard
from ..idempotency.claims import Idempotent, fingerprint_of, idempotent
from ..idempotency.one_commit import claim_in_transaction, record_failure, record_result
from ..idempotency.store import record_model
from ..locks import notes
from ..locks.lock import Lock, reset_current_lock, set_current_lock
from . import async_body
from .abort import Abort, commit_begins
from .job_transaction import job_transaction
from .outcomes import JobOutcome, Run, finish
from .requeue import Ending, conflict, requeue
from .spec import JobSpec, OnConflict

# Reading the operator's note on the loss path: never wait long for a Redis that may be gone.
_NOTE_TIMEOUT = 1.0
_AUDIT_ID_WAIT = 2.0


def run(spec: JobSpec[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``spec.func(*args, **kwargs)`` under the safe flow (see the module docs)."""
    arguments = spec.bind(args, kwargs)
    job = get_current_job()
    if job is not None and job.func_name != spec.name:
        job = None  # called inline from another job
    worker = job is not None and getattr(job, "worker_name", None) != "sync"
    state = Run(spec, spec.resource(arguments), spec.key(arguments), job, worker)
    try:
        try:
            if spec.awaited:
                call = functools.partial(async_body.call, spec.func, args, kwargs)
            else:
                call = functools.partial(spec.func, *args, **kwargs)
            outcome, result, extra = _flow(state, arguments, call)
        except Exception as exc:
            failed = JobOutcome.ABORTED if isinstance(exc, LockLost) else JobOutcome.FAILED
            if isinstance(exc, LockContentionTimeout):
                failed = JobOutcome.GAVE_UP
            finish(state, failed, reason=f"{type(exc).__name__}: {exc}")
            raise
        finish(state, outcome, **extra)
        return result
    finally:
        state.release([])  # finish() did, unless it raised
        state.note_duration()
        # Whatever this run counted and no lock release carried: the horse may os._exit next.
        if metrics.flush_at_job_end():
            metrics.flush_now()


def _flow(state: Run, arguments: dict[str, Any], call: Callable[[], Any]) -> Ending:
    spec = state.spec
    if state.resource is None:
        state.started()
        try:
            return _claim_and_run(state, arguments, call, None)
        except IdempotencyInProgress as exc:
            return conflict(state, None, exc)
    abort = Abort(spec.on_lost)
    held = Lock(
        state.resource,
        ttl=spec.ttl,
        heartbeat=spec.heartbeat,
        on_lost=abort.lost,
        limit=spec.concurrency,
    )
    try:  # a worker tries once (admission let it start); an inline call waits ACQUIRE_WAIT
        acquired = held.acquire(wait=0.0 if state.worker else None)
    except LockBackendUnavailable as exc:
        if not state.worker or spec.on_conflict is not OnConflict.REQUEUE:
            raise
        # As if busy: failing would free its slot, and RQ would promote and fail the next job.
        return requeue(state, held, f"the lock's Redis did not answer ({exc})", None)
    if not acquired:
        return conflict(state, held, None)
    state.held = held  # released by finish(), its outcome riding the release
    state.started()
    token = set_current_lock(held)
    try:
        armed = abort if conf.get().ON_LOCK_LOST == "abort" else contextlib.nullcontext()
        try:
            with armed:
                return _claim_and_run(state, arguments, call, held)
        except LockLost as exc:
            note = _operator_note(held)
            if note is None:
                raise
            message = f"Job aborted: its lock was {note.describe()}"
            raise LockLost(message, resource=held.resource, key=held.key, owner=held.owner) from exc
    except (IdempotencyInProgress, ResourceInTransaction) as exc:
        return conflict(state, held, exc)
    finally:
        reset_current_lock(token)


def _operator_note(held: Lock) -> notes.OperatorRelease | None:
    """Did an operator release this holding? One GET, repeated for up to ``_AUDIT_ID_WAIT`` s
    while the note lacks its audit id (written after the release; on SQLite, after our commit)."""
    try:
        found = client(held.cache, _NOTE_TIMEOUT)
        note = notes.read(found, held.keys.released, held.owner)
        deadline = time.monotonic() + _AUDIT_ID_WAIT
        while note is not None and note.audit is None and time.monotonic() < deadline:
            time.sleep(0.05)
            note = notes.read(found, held.keys.released, held.owner) or note
        return note
    except REDIS_ERRORS:
        return None  # Redis is gone too: the plain loss reason stands


def _guard_wait(state: Run, held: Lock) -> float:
    """How long a run waits for its resource's transaction guard: a worker's up to the lock's TTL
    (a paused previous holder's transaction is ended meanwhile,
    :mod:`..idempotency.resource_guard`; the jobs parked behind it keep their order), an inline
    one ``ACQUIRE_WAIT``, as for the lock."""
    return held.ttl if state.worker else conf.get().ACQUIRE_WAIT


def _claim_and_run(
    state: Run, arguments: dict[str, Any], call: Callable[[], Any], held: Lock | None
) -> Ending:
    spec = state.spec
    key = state.key
    if key is None and not spec.atomic:
        return JobOutcome.RAN, call(), {}  # its own transactions: fenced
    using = str(router.db_for_write(record_model()))
    if key is None:
        with job_transaction(using, held, wait=0.0 if held is None else _guard_wait(state, held)):
            result = call()
        return JobOutcome.RAN, result, {}
    claiming = idempotent(key, scope=spec.scope, fingerprint=fingerprint_of(arguments), using=using)
    if held is not None:
        return _one_commit(state, claiming, call, held)
    with claiming as claim:  # no lock: the claim commits on its own first (module docs)
        if claim.done:
            return JobOutcome.REPLAYED, claim.result, {}
        with transaction.atomic(using=claim.using):
            result = call()
            claim.succeed(result)
        return JobOutcome.RAN, result, {}


def _one_commit(state: Run, claim_spec: Idempotent, call: Callable[[], Any], held: Lock) -> Ending:
    """Claim, effect and success record in one transaction (see the module docs)."""
    claimed = False
    try:
        with transaction.atomic(using=claim_spec.using):
            try:  # one statement takes the guard and claims the key
                claim = claim_in_transaction(claim_spec, held)
            except ResourceInTransaction:
                resource_guard.take(claim_spec.using, held, wait=_guard_wait(state, held))
                claim = claim_in_transaction(claim_spec, held)
            claimed = True
            if claim.done:
                return JobOutcome.REPLAYED, claim.result, {}
            result = call()
            held.ensure_held()  # never commit the effect of a job that lost its lock
            record_result(claim, result)
            commit_begins()  # a loss from here on is reported, not raised inside COMMIT
        return JobOutcome.RAN, result, {}
    except (IdempotencyInProgress, LockLost):
        raise  # after a loss the key is someone else's too: leave its record alone
    except BaseException as exc:
        if isinstance(exc, DatabaseError) and not claimed and "locked" in str(exc):
            # SQLite: another transaction kept the write lock past the busy timeout.
            why = (
                f"Idempotency key {claim_spec.key!r}: the database stayed locked by another "
                f"transaction ({exc}); treated as in progress."
            )
            raise IdempotencyInProgress(why, key=claim_spec.key, scope=claim_spec.scope) from exc
        if claimed:
            record_failure(claim_spec, f"{type(exc).__name__}: {exc}")
        raise

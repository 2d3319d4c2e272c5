"""One commit per job: under a held lock, ``@locked_job`` claims the key with
:func:`claim_in_transaction` as the first statement of the job's transaction and records the result
with :func:`record_result` before its one commit; a run that raised leaves a ``failed`` record with
:func:`record_failure` after its rollback (docs/idempotency.md)."""

from __future__ import annotations

from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.models import F
from django.utils import timezone

from ..choices import RecordStatus
from ..exceptions import IdempotencyError, IdempotencyInProgress
from ..locks.info import job_context
from ..locks.lock import Lock
from ..logs import logger
from .claims import Claim, Idempotent, claim
from .inputs import check_result, error_for, storable_error
from .store import cut_job_id, expiry, in_progress_on_busy, insert, record_model, try_guard


def claim_in_transaction(spec: Idempotent, held: Lock | None = None) -> Claim:
    """Claim ``spec.key`` in the caller's transaction (:class:`IdempotencyError` outside one),
    already as it will commit (``succeeded``), with the effect: a crash leaves no claim. A
    concurrent run of the key raises :class:`IdempotencyInProgress` without waiting long; with
    ``held``, the same statement takes its resource guard (:mod:`.guard`)."""
    if not connections[spec.using].in_atomic_block:
        why = "can be claimed in a transaction only inside transaction.atomic()."
        raise error_for(IdempotencyError, spec.key, spec.scope, why)
    with in_progress_on_busy(spec.using, scope=spec.scope, key=spec.key):
        return claim(spec, guard=True, finished=True, under=held)


def record_result(held: Claim, result: Any) -> None:
    """Store the job's ``result`` in its claim's record, in the same transaction (one statement
    at most); :class:`IdempotencyError` for a result that is not JSON (the job then fails),
    :class:`IdempotencyInProgress` when another run recorded the key first (see below)."""
    check_result(result, key=held.key, scope=held.scope)
    held.result = result
    if held.pending is not None:
        # PostgreSQL: inserted now, with the result (the guard kept other runs out). A run
        # that committed the key meanwhile (an unguarded idempotent() block, or one whose commit
        # the claim's read just missed: .store) wins on the unique key; this run is rolled back
        # and goes again as busy (on_conflict), to replay that result.
        now = timezone.now()
        values = {
            **held.pending,
            "result": result,
            "updated_at": now,
            "finished_at": now,
            "expires_at": expiry(now),
        }
        record_id = insert(record_model(), held.using, values)
        if record_id is None:
            why = "was recorded by another run meanwhile; this run's effect is rolled back."
            raise error_for(IdempotencyInProgress, held.key, held.scope, why)
        held.record_id = record_id
        held.pending = None
    elif result is not None:
        mine = record_model().objects.using(held.using).filter(pk=held.record_id, token=held.token)
        mine.update(result=result)


def record_failure(spec: Idempotent, error: str) -> None:
    """After a one-commit run raised and rolled back (its claim too), leave a ``failed`` record:
    best effort, in a short transaction, never over another run's record, never waiting."""
    model = record_model()
    now = timezone.now()
    error = storable_error(error, 10_000)
    values: dict[str, Any] = {
        "scope": spec.scope,
        "key": spec.key,
        "fingerprint": spec.fingerprint,
        "status": RecordStatus.FAILED,
        "error": error,
        "rq_job_id": cut_job_id(model, job_context()[0]),
        "created_at": now,
        "updated_at": now,
        "finished_at": now,
        "expires_at": expiry(now),
    }
    try:
        with transaction.atomic(using=spec.using):
            with in_progress_on_busy(spec.using, scope=spec.scope, key=spec.key):
                if not try_guard(spec.using, spec.scope, spec.key):
                    return  # another run is claiming the key: the record is its now
                if insert(model, spec.using, values) is None:
                    again = {"attempts": F("attempts") + 1, "updated_at": now, "finished_at": now}
                    failed = model.objects.using(spec.using).filter(scope=spec.scope, key=spec.key)
                    failed.filter(status=RecordStatus.FAILED).update(error=error, **again)
    except (DatabaseError, IdempotencyInProgress):
        logger.warning("could not record the failure of key %r", spec.key, exc_info=True)

"""One commit per job: the idempotency claim inside the job's own transaction.

Under a held lock, ``@locked_job`` claims the key with :func:`claim_in_transaction` as the first
statement of the job's transaction, runs the body, records the result and commits once
(:mod:`django_joblock.jobs.runner`). A run that raised leaves a ``failed`` record through
:func:`record_failure` after its rollback. The claim protocol itself is :func:`.claims.claim`'s.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.models import F
from django.utils import timezone

from ..choices import RecordStatus
from ..exceptions import IdempotencyClaimLost, IdempotencyError, IdempotencyInProgress
from ..locks.info import job_context
from ..locks.lock import Lock
from .claims import Claim, Idempotent, claim
from .inputs import check_result
from .store import expiry, in_progress_on_busy, insert, record_model, try_guard

logger = logging.getLogger("django_joblock")


def claim_in_transaction(spec: Idempotent, held: Lock | None = None) -> Claim:
    """Claim ``spec.key`` as the first statement of the caller's transaction, already as it
    will be committed (``succeeded``): it commits or rolls back with the effect and the result
    (:func:`record_result`), so a crash leaves no claim to lease out. A concurrent run of the
    key raises :class:`IdempotencyInProgress` without waiting long (:mod:`.store`); with
    ``held``, the same statement takes its resource guard (:mod:`.guard`). Raises
    :class:`IdempotencyError` outside a transaction on ``spec.using``."""
    if not connections[spec.using].in_atomic_block:
        raise IdempotencyError(
            "claim_in_transaction() must run inside transaction.atomic()",
            key=spec.key,
            scope=spec.scope,
        )
    with in_progress_on_busy(spec.using, scope=spec.scope, key=spec.key):
        return claim(spec, guard=True, finished=True, under=held)


def record_result(held: Claim, result: Any) -> None:
    """Store the job's ``result`` in the record of :func:`claim_in_transaction`, in the same
    transaction: one statement at most. :class:`IdempotencyError` for a result that is not JSON
    (the job then fails and its transaction rolls back)."""
    check_result(result, key=held.key, scope=held.scope)
    held.result = result
    if held.pending is not None:
        # PostgreSQL: the row was not inserted at the claim (its guard kept other runs out);
        # insert it now, with the result. Someone unguarded committed the key meanwhile
        # (an idempotent() block of the same scope): the unique key decides against us.
        now = timezone.now()
        values = {**held.pending, "result": result, "updated_at": now, "finished_at": now}
        values["expires_at"] = expiry(now)
        record_id = insert(record_model(), held.using, values)
        if record_id is None:
            raise IdempotencyClaimLost(
                f"Idempotency key {held.key!r} (scope {held.scope!r}) was recorded by another "
                "run meanwhile; this run's effect is rolled back.",
                key=held.key,
                scope=held.scope,
            )
        held.record_id, held.pending = record_id, None
    elif result is not None:
        mine = record_model().objects.using(held.using).filter(pk=held.record_id, token=held.token)
        mine.update(result=result)


def record_failure(spec: Idempotent, error: str) -> None:
    """After a one-commit run raised and rolled back (its claim too), leave a ``failed`` record
    with the error, as a separate claim does: best effort, in its own short transaction, never
    over a record another run has claimed or finished meanwhile, never waiting for one."""
    model = record_model()
    now = timezone.now()
    error = error[:10_000]
    values: dict[str, Any] = {"scope": spec.scope, "key": spec.key, "fingerprint": spec.fingerprint}
    values.update(status=RecordStatus.FAILED, error=error, rq_job_id=job_context()[0])
    values.update(created_at=now, updated_at=now, finished_at=now, expires_at=expiry(now))
    try:
        with transaction.atomic(using=spec.using):
            with in_progress_on_busy(spec.using, scope=spec.scope, key=spec.key):
                if not try_guard(spec.using, spec.scope, spec.key):
                    return  # another run is claiming the key: the record is its now
                if insert(model, spec.using, values) is None:
                    model.objects.using(spec.using).filter(
                        scope=spec.scope, key=spec.key, status=RecordStatus.FAILED
                    ).update(
                        error=error, attempts=F("attempts") + 1, updated_at=now, finished_at=now
                    )
    except (DatabaseError, IdempotencyInProgress):
        logger.warning("could not record the failure of key %r", spec.key, exc_info=True)

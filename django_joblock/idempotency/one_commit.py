"""One commit per job (§4.9): the idempotency claim inside the job's own transaction.

Under a held lock, ``@locked_job`` claims the key with :func:`claim_in_transaction` as the first
statement of the job's transaction, runs the body, records the success, and commits once
(:mod:`django_joblock.runner`). A run that raised leaves a ``failed`` record through
:func:`record_failure` after its rollback. The protocol of the claim itself (insert, read,
takeover) is :func:`django_joblock.idempotency.claim`'s.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.models import F
from django.utils import timezone

from .. import conf
from ..choices import RecordStatus
from ..exceptions import IdempotencyClaimLost, IdempotencyError, IdempotencyInProgress
from ..locks.info import job_context
from ..locks.lock import Lock
from .claims import Claim, Idempotent, claim
from .inputs import check_result
from .store import in_progress_on_busy, insert, set_result, try_guard

logger = logging.getLogger("django_joblock")


def _record_model() -> Any:
    from ..models import IdempotencyRecord

    return IdempotencyRecord


def claim_in_transaction(spec: Idempotent, held: Lock | None = None) -> Claim:
    """Claim ``spec.key`` inside the caller's transaction, for the one-commit flow (§4.9).

    The claim row is inserted (or taken over) by the first statement of the caller's
    transaction, already as it will be committed (``succeeded``), and is not committed on its
    own: it commits with the effect and the result (:func:`record_result`), or rolls back with
    them (a crash leaves no claim to lease out). A concurrent run
    of the same key (possible only after a lock loss) does not wait for it: on PostgreSQL it
    finds the key's guard taken, on SQLite it waits at most the busy timeout; either way it
    raises :class:`IdempotencyInProgress`. Of two runs, at most one commits (the unique key).
    With the run's ``held`` lock, the same statement takes its resource guard on PostgreSQL
    (:mod:`django_joblock.resource_guard`): :class:`~django_joblock.ResourceInTransaction`
    when the resource's previous holder is still inside its transaction.
    Raises :class:`IdempotencyError` outside a transaction on ``spec.using``.
    """
    if not connections[spec.using].in_atomic_block:
        raise IdempotencyError(
            "claim_in_transaction() must run inside transaction.atomic()",
            key=spec.key,
            scope=spec.scope,
        )
    with in_progress_on_busy(spec.using, scope=spec.scope, key=spec.key):
        return claim(spec, guard=True, finished=True, under=held)


def record_result(held: Claim, result: Any) -> None:
    """Store the job's ``result`` in the record claimed by :func:`claim_in_transaction`, in the
    same transaction. The row was written ``succeeded`` already: nothing to do for ``None``,
    else one ``UPDATE`` of the (unindexed) result column.

    Raises :class:`IdempotencyError` for a result that cannot be stored as JSON (the job then
    fails and its transaction rolls back), as :meth:`Claim.succeed` does.
    """
    try:
        check_result(result)
    except (TypeError, ValueError) as exc:
        raise IdempotencyError(
            f"Result for idempotency key {held.key!r} cannot be stored as JSON "
            f"(DjangoJSONEncoder, no NaN or infinity): {exc}",
            key=held.key,
            scope=held.scope,
        ) from exc
    held.result = result
    if held.pending is not None:
        # PostgreSQL: the row was not inserted at the claim (its guard kept other runs out);
        # insert it now, with the result. Someone unguarded committed the key meanwhile
        # (an idempotent() block of the same scope): the unique key decides against us.
        now = timezone.now()
        values = {
            **held.pending,
            "result": result,
            "updated_at": now,
            "finished_at": now,
            "expires_at": now + timedelta(seconds=conf.get().IDEMPOTENCY_TTL),
        }
        record_id = insert(_record_model(), held.using, values)
        if record_id is None:
            raise IdempotencyClaimLost(
                f"Idempotency key {held.key!r} (scope {held.scope!r}) was recorded by another "
                "run meanwhile; this run's effect is rolled back.",
                key=held.key,
                scope=held.scope,
            )
        held.record_id, held.pending = record_id, None
    elif result is not None:
        set_result(_record_model(), held.using, held.record_id, held.token, result)


def record_failure(spec: Idempotent, error: str) -> None:
    """After a one-commit run raised (and its transaction rolled back, claim included), leave a
    ``failed`` record with the error, as a separate claim does: best effort, in its own short
    transaction, never over a record another run has claimed or finished meanwhile (and never
    waiting for one that is being claimed)."""
    model = _record_model()
    now = timezone.now()
    values = {
        "scope": spec.scope,
        "key": spec.key,
        "fingerprint": spec.fingerprint,
        "status": RecordStatus.FAILED,
        "result": None,
        "error": error[:10_000],
        "token": "",
        "fence": None,
        "lock_resource": "",
        "rq_job_id": job_context()[0],
        "attempts": 1,
        "lease_expires_at": None,
        "created_at": now,
        "updated_at": now,
        "finished_at": now,
        "expires_at": now + timedelta(seconds=conf.get().IDEMPOTENCY_TTL),
    }
    try:
        with transaction.atomic(using=spec.using):
            with in_progress_on_busy(spec.using, scope=spec.scope, key=spec.key):
                if not try_guard(spec.using, spec.scope, spec.key):
                    return  # another run is claiming the key: the record is its now
                if insert(model, spec.using, values) is None:
                    model.objects.using(spec.using).filter(
                        scope=spec.scope, key=spec.key, status=RecordStatus.FAILED
                    ).update(
                        error=values["error"],
                        attempts=F("attempts") + 1,
                        updated_at=now,
                        finished_at=now,
                    )
    except (DatabaseError, IdempotencyInProgress):
        logger.warning("could not record the failure of key %r", spec.key, exc_info=True)

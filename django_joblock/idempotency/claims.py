"""Idempotency claims: an effect is applied once even when a job runs twice.

    with idempotent("refund:R-1", scope="refunds", fingerprint=args) as claim:
        if claim.done:
            return claim.result              # an earlier run succeeded: replay its result
        with transaction.atomic():
            Refund.objects.create(...)       # the business write ...
            claim.succeed({"refund": 42})    # ... and the marker, in the same transaction

Protocol (no read-then-write window):

1. ``INSERT ... ON CONFLICT DO NOTHING RETURNING id``: the first claimer of a key owns it.
   One statement on the happy path (:mod:`.store`).
2. Otherwise read the row (on PostgreSQL in that same statement: a replay is one query).
   ``succeeded``: replay (``claim.done``; the ``duplicate_blocked`` signal is sent).
   ``running`` with a live lease: :class:`IdempotencyInProgress`, unless it was claimed under
   an older fence of the very lock this claim holds now (that claimer lost the lock, so its
   claim is dead: taken over at once). Another fingerprint: :class:`IdempotencyKeyMismatch`.
   ``failed``, or ``running`` with an expired lease (its owner died): take it over with a
   compare-and-set ``UPDATE`` on the token, status and attempts just read; ``attempts`` goes
   up by one. Losing that race reads again.
3. ``claim.succeed(result)``: ``UPDATE ... WHERE token = <this claim's> AND status = 'running'``,
   one statement, inside the caller's transaction, so a rollback of the business write rolls
   the marker back too. If the lease was taken over meanwhile, it raises
   :class:`IdempotencyClaimLost` and writes nothing.
4. Leaving the block with an exception marks the record ``failed`` with the error text (again
   only while this claim is the owner): the next claim runs again. Leaving it normally without
   ``succeed()`` records a success with result ``None``; a ``succeed()`` that was rolled back
   is recorded as failed.

Keys, scopes and results are validated by :mod:`.inputs`: results
are stored with ``DjangoJSONEncoder``, so a *replay* returns strings for ``Decimal``,
``datetime``, ``UUID``... (docs/idempotency.md lists them).

Leases and expiry use this server's clock (``timezone.now()``): keep app servers NTP-synced.
A claim (new or taken over) expires ``IDEMPOTENCY_TTL`` after it was made, a success
``IDEMPOTENCY_TTL`` after it was recorded; ``joblock_purge`` never deletes a running claim
whose lease is live, whatever its ``expires_at``.
Works on PostgreSQL and SQLite (>= 3.35, for ``RETURNING``); other databases use a savepoint
and ``IntegrityError`` for step 1 (one more statement).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

from django.db import connections, router, transaction
from django.db.models import F
from django.utils import timezone
from rq import get_current_job

from .. import conf, metrics
from ..choices import RecordStatus
from ..exceptions import (
    IdempotencyClaimLost,
    IdempotencyError,
    IdempotencyInProgress,
    IdempotencyKeyMismatch,
)
from ..locks.lock import Lock, current_lock
from ..signals import duplicate_blocked
from .guard import refused
from .inputs import (
    MAX_KEY_LENGTH,
    MAX_SCOPE_LENGTH,
    check_result,
    fingerprint_of,
    key_family,
    validate_key,
    validate_scope,
)
from .store import (
    ABSENT,
    EXISTING,
    GUARDED,
    INSERTED,
    RESOURCE_GUARDED,
    in_progress,
    insert_or_read,
)

__all__ = [
    "MAX_KEY_LENGTH",
    "MAX_SCOPE_LENGTH",
    "Claim",
    "Idempotent",
    "check_result",
    "claim",
    "fingerprint_of",
    "idempotent",
    "validate_key",
    "validate_scope",
]

_TAKEOVER_TRIES = 5


def _model() -> Any:
    from ..models import IdempotencyRecord

    return IdempotencyRecord


def _current_job() -> Any:
    try:
        return get_current_job()
    except Exception:  # noqa: BLE001 - outside a worker rq may raise on a missing connection
        return None


def _job_id() -> str:
    job = _current_job()
    return (job.id or "") if job is not None else ""


def _job_func() -> str:
    job = _current_job()
    return (job.func_name or "") if job is not None else ""


@dataclass
class Claim:
    """The outcome of claiming a key. ``done``: an earlier success, ``result`` its result."""

    key: str
    scope: str
    fingerprint: str
    token: str
    record_id: int
    attempts: int
    using: str
    done: bool = False
    result: Any = None
    # A claim inside a job's transaction on PostgreSQL: the row to insert with the result at
    # the end (record_id is 0 until then); see django_joblock.one_commit.
    pending: dict[str, Any] | None = field(default=None, repr=False)
    _succeed_called: bool = field(default=False, repr=False)
    _committed: bool = field(default=False, repr=False)

    def succeed(self, result: Any = None) -> None:
        """Record success with ``result`` (JSON-serialisable) in the current transaction.

        Raises :class:`IdempotencyClaimLost` if another claim has taken the lease over, and
        :class:`IdempotencyError` on a replayed claim or a result that is not JSON.
        """
        if self.done:
            raise IdempotencyError(
                f"Key {self.key!r} was already done; nothing to record.",
                key=self.key,
                scope=self.scope,
            )
        try:
            check_result(result)
        except (TypeError, ValueError) as exc:
            raise IdempotencyError(
                f"Result for idempotency key {self.key!r} cannot be stored as JSON "
                f"(DjangoJSONEncoder, no NaN or infinity): {exc}",
                key=self.key,
                scope=self.scope,
            ) from exc
        now = timezone.now()
        updated = self._mine().update(
            status=RecordStatus.SUCCEEDED,
            result=result,
            error="",
            finished_at=now,
            updated_at=now,
            lease_expires_at=None,
            expires_at=now + timedelta(seconds=conf.get().IDEMPOTENCY_TTL),
        )
        if updated != 1:
            raise IdempotencyClaimLost(
                f"Idempotency key {self.key!r} (scope {self.scope!r}): this claim's lease was "
                "taken over by another claim; its success was not recorded.",
                key=self.key,
                scope=self.scope,
            )
        self._succeed_called = True
        self.result = result
        transaction.on_commit(self._mark_committed, using=self.using)

    def _mark_committed(self) -> None:
        self._committed = True

    def _mine(self) -> Any:
        return (
            _model()
            .objects.using(self.using)
            .filter(pk=self.record_id, token=self.token, status=RecordStatus.RUNNING)
        )

    def end(self, exc: BaseException | None) -> None:
        """Leaving the claim's block: an exception marks the record failed; a ``succeed()``
        rolled back with its transaction too; leaving without ``succeed()`` records ``None``.
        A recorded success (or one that commits with an enclosing transaction) stays."""
        if self.done:
            return
        if exc is not None:
            self._fail(f"{type(exc).__name__}: {exc}")
        elif self._committed or (self._succeed_called and connections[self.using].in_atomic_block):
            return
        elif self._succeed_called:
            self._fail("succeed() was rolled back with its transaction")
        else:
            self.succeed(None)

    def _fail(self, error: str) -> None:
        now = timezone.now()
        self._mine().update(
            status=RecordStatus.FAILED,
            error=error[:10_000],
            finished_at=now,
            updated_at=now,
            lease_expires_at=None,
        )


class Idempotent:
    """Claim ``key`` (within ``scope``) for the duration of the block; see the module docs.
    Made by :func:`idempotent`.

    ``fingerprint``: any JSON-serialisable value describing the arguments (hashed with
    sha256); the same key with another fingerprint raises :class:`IdempotencyKeyMismatch`.
    ``lease`` (s, default ``JOBLOCK["IDEMPOTENCY_LEASE"]``): how long a running claim keeps
    others out before it is presumed dead. ``using``: the database alias.
    """

    def __init__(
        self,
        key: str,
        *,
        scope: str = "",
        fingerprint: Any = None,
        lease: float | None = None,
        using: str | None = None,
    ) -> None:
        validate_key(key)
        validate_scope(scope)
        self.key = key
        self.scope = scope
        self.fingerprint = "" if fingerprint is None else fingerprint_of(fingerprint)
        self.lease = (
            conf.LEASE_RANGE.check("idempotent(): lease", lease)
            if lease is not None
            else conf.get().IDEMPOTENCY_LEASE
        )
        self.using = using or router.db_for_write(_model())
        self.claim: Claim | None = None

    def __enter__(self) -> Claim:
        self.claim = claim(self)
        return self.claim

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.claim is not None:
            self.claim.end(exc)


def idempotent(
    key: str,
    *,
    scope: str = "",
    fingerprint: Any = None,
    lease: float | None = None,
    using: str | None = None,
) -> Idempotent:
    """``with idempotent(key, scope=..., fingerprint=..., lease=...) as claim:`` claims
    ``key`` for the block (see :class:`Idempotent` and the module docs)."""
    return Idempotent(key, scope=scope, fingerprint=fingerprint, lease=lease, using=using)


def claim(
    spec: Idempotent,
    *,
    guard: bool = False,
    finished: bool = False,
    under: Lock | None = None,
) -> Claim:
    """Claim ``spec.key`` race-free; see the module docs for the protocol.

    ``guard``, ``finished`` and ``under`` are for a claim inside a job's transaction
    (:func:`.one_commit.claim_in_transaction`): the key's guard is taken in the
    same statement (and, ``under`` a held lock, its resource guard: raises
    :class:`~django_joblock.ResourceInTransaction` when taken, see
    :mod:`.guard`), and the row is written as it will be committed
    (``succeeded``, finished now, no lease), since nobody sees it before the commit and a
    rollback removes it.
    """
    model = _model()
    token = secrets.token_hex(16)
    now = timezone.now()
    status = RecordStatus.SUCCEEDED if finished else RecordStatus.RUNNING
    lease = None if finished else now + timedelta(seconds=spec.lease)
    finished_at = now if finished else None
    held = current_lock()
    fence = held.fence if held is not None and held.held else None
    resource = held.resource if fence is not None and held is not None else ""
    job_id = _job_id()
    values = {
        "scope": spec.scope,
        "key": spec.key,
        "fingerprint": spec.fingerprint,
        "status": status,
        "result": None,
        "error": "",
        "token": token,
        "fence": fence,
        "lock_resource": resource,
        "rq_job_id": job_id,
        "attempts": 1,
        "lease_expires_at": lease,
        "created_at": now,
        "updated_at": now,
        "finished_at": finished_at,
        "expires_at": now + timedelta(seconds=conf.get().IDEMPOTENCY_TTL),
    }
    for _ in range(_TAKEOVER_TRIES):
        found, record_id, row = insert_or_read(
            model,
            spec.using,
            values,
            guard=guard,
            lock_key=under.key if guard and under is not None else None,
        )
        if found == RESOURCE_GUARDED:
            assert under is not None
            raise refused(under)
        if found == INSERTED:
            assert record_id is not None
            return Claim(spec.key, spec.scope, spec.fingerprint, token, record_id, 1, spec.using)
        if found == ABSENT:  # guarded, nothing there: the row is inserted at the end
            return Claim(
                spec.key, spec.scope, spec.fingerprint, token, 0, 1, spec.using, pending=values
            )
        if found == GUARDED:
            raise in_progress(spec.scope, spec.key, "its guard is taken")
        if found != EXISTING or row is None:
            continue  # purged, or committed just too late for that statement: ask again
        if spec.fingerprint and row["fingerprint"] and row["fingerprint"] != spec.fingerprint:
            raise IdempotencyKeyMismatch(
                f"Idempotency key {spec.key!r} (scope {spec.scope!r}) was used with other "
                f"arguments (fingerprint {row['fingerprint'][:12]}..., now "
                f"{spec.fingerprint[:12]}...).",
                key=spec.key,
                scope=spec.scope,
            )
        if row["status"] == RecordStatus.SUCCEEDED:
            done = Claim(
                spec.key,
                spec.scope,
                row["fingerprint"],
                token,
                row["id"],
                row["attempts"],
                spec.using,
                done=True,
                result=row["result"],
            )
            duplicate_blocked.send(sender=model, key=spec.key, scope=spec.scope, record=done)
            metrics.count("duplicates_blocked", key_family(spec.key), _job_func())
            return done
        now = timezone.now()
        lease_until: datetime | None = row["lease_expires_at"]
        superseded = (
            # Claimed under an older holding of the lock we hold now: that holder has lost
            # the lock (we have it, with a larger fence), so its claim is dead whatever its
            # lease says. This is what lets a retry run right after a SIGKILLed work horse.
            fence is not None
            and row["fence"] is not None
            and row["lock_resource"] == resource
            and row["fence"] < fence
        )
        live = (
            row["status"] == RecordStatus.RUNNING and lease_until is not None and lease_until > now
        )
        if live and not superseded and lease_until is not None:
            raise IdempotencyInProgress(
                f"Idempotency key {spec.key!r} (scope {spec.scope!r}) is being processed by "
                f"another claim (attempt {row['attempts']}, lease for another "
                f"{(lease_until - now).total_seconds():.1f}s).",
                key=spec.key,
                scope=spec.scope,
            )
        taken = (
            model.objects.using(spec.using)
            .filter(
                pk=row["id"], token=row["token"], status=row["status"], attempts=row["attempts"]
            )
            .update(
                token=token,
                status=status,
                attempts=F("attempts") + 1,
                error="",
                fence=fence,
                lock_resource=resource,
                rq_job_id=job_id,
                updated_at=now,
                finished_at=finished_at if finished else None,
                lease_expires_at=None if finished else now + timedelta(seconds=spec.lease),
                # A takeover is a new claim: it lives a full TTL from now, like an insert.
                expires_at=now + timedelta(seconds=conf.get().IDEMPOTENCY_TTL),
                fingerprint=spec.fingerprint or row["fingerprint"],
            )
        )
        if taken == 1:
            return Claim(
                spec.key,
                spec.scope,
                spec.fingerprint or row["fingerprint"],
                token,
                row["id"],
                row["attempts"] + 1,
                spec.using,
            )
    raise IdempotencyInProgress(
        f"Idempotency key {spec.key!r} (scope {spec.scope!r}) changed hands "
        f"{_TAKEOVER_TRIES} times while claiming; another claim is active.",
        key=spec.key,
        scope=spec.scope,
    )

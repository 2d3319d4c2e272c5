"""Idempotency claims: an effect is applied once even when a job runs twice.

    with idempotent("refund:R-1", scope="refunds", fingerprint=args) as claim:
        if claim.done:
            return claim.result              # an earlier run succeeded: replay its result
        with transaction.atomic():
            Refund.objects.create(...)       # the business write ...
            claim.succeed({"refund": 42})    # ... and the marker, in the same transaction

Protocol, with no read-then-write window:

1. ``INSERT ... ON CONFLICT DO NOTHING``: the first claimer of a key owns it (one statement,
   :mod:`.store`). Otherwise the row is read, on PostgreSQL in that same statement:
   ``succeeded`` is replayed (``claim.done``, signal ``duplicate_blocked``); another fingerprint
   raises :class:`IdempotencyKeyMismatch`; ``running`` with a live lease raises
   :class:`IdempotencyInProgress`, unless claimed under an older fence of the lock held now
   (that claimer lost the lock: its claim is dead). ``failed`` or an expired lease (its owner
   died) is taken over by a compare-and-set ``UPDATE`` on the token, status and attempts read
   (``attempts`` + 1); losing that race reads again.
2. ``claim.succeed(result)``: one ``UPDATE ... WHERE token = <this claim's> AND status =
   'running'`` in the caller's transaction, so the marker rolls back with the business write.
   A lease taken over meanwhile raises :class:`IdempotencyClaimLost` and writes nothing.
3. Leaving the block with an exception marks the record ``failed`` (only while this claim owns
   it): the next claim runs again. Leaving without ``succeed()`` records a success with result
   ``None``; a ``succeed()`` that was rolled back is recorded as failed.

A replay returns results as ``DjangoJSONEncoder`` stored them (strings for ``Decimal``,
``datetime``, ``UUID``...). Leases and expiry use this server's clock (keep it NTP-synced): a
record expires ``IDEMPOTENCY_TTL`` after its claim, takeover or success, but ``joblock_purge``
never deletes a running claim whose lease is live. Needs SQLite >= 3.35 (``RETURNING``).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connections, router, transaction
from django.db.models import F
from django.utils import timezone

from .. import conf, metrics
from ..choices import RecordStatus
from ..exceptions import (
    IdempotencyClaimLost,
    IdempotencyError,
    IdempotencyInProgress,
    IdempotencyKeyMismatch,
)
from ..locks.info import job_context
from ..locks.lock import Lock, current_lock
from ..signals import duplicate_blocked
from . import store
from .guard import refused
from .inputs import check_result, fingerprint_of, key_family, validate_key, validate_scope

__all__ = ["Claim", "Idempotent", "claim", "fingerprint_of", "idempotent"]

_TAKEOVER_TRIES = 5


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
    # the end (record_id is 0 until then); see .one_commit.
    pending: dict[str, Any] | None = field(default=None, repr=False)
    _succeed_called: bool = field(default=False, repr=False)
    _committed: bool = field(default=False, repr=False)

    def succeed(self, result: Any = None) -> None:
        """Record success with ``result`` (JSON) in the current transaction (step 2).
        :class:`IdempotencyError` on a replayed claim or a result that is not JSON."""
        if self.done:
            raise IdempotencyError(
                f"Key {self.key!r} was already done; nothing to record.",
                key=self.key,
                scope=self.scope,
            )
        check_result(result, key=self.key, scope=self.scope)
        expires_at = store.expiry(timezone.now())
        updated = self._finish(RecordStatus.SUCCEEDED, result=result, expires_at=expires_at)
        if updated != 1:
            raise IdempotencyClaimLost(
                f"Idempotency key {self.key!r} (scope {self.scope!r}): this claim's lease was "
                "taken over by another claim; its success was not recorded.",
                key=self.key,
                scope=self.scope,
            )
        self._succeed_called = True
        self.result = result
        transaction.on_commit(lambda: setattr(self, "_committed", True), using=self.using)

    def _finish(self, status: RecordStatus, error: str = "", **fields: Any) -> int:
        """Finish this claim's record now, only while this claim still owns it."""
        now = timezone.now()
        return int(
            store.record_model()
            .objects.using(self.using)
            .filter(pk=self.record_id, token=self.token, status=RecordStatus.RUNNING)
            .update(
                status=status,
                error=error[:10_000],
                finished_at=now,
                updated_at=now,
                lease_expires_at=None,
                **fields,
            )
        )

    def end(self, exc: BaseException | None) -> None:
        """Leave the claim's block (step 3 of the module docs). A recorded success, or one that
        commits with an enclosing transaction, stays."""
        if self.done:
            return
        if exc is not None:
            self._finish(RecordStatus.FAILED, f"{type(exc).__name__}: {exc}")
        elif self._committed or (self._succeed_called and connections[self.using].in_atomic_block):
            return
        elif self._succeed_called:
            self._finish(RecordStatus.FAILED, "succeed() was rolled back with its transaction")
        else:
            self.succeed(None)


class Idempotent:
    """Claim ``key`` (within ``scope``) for the block; see the module docs. ``fingerprint``:
    a value describing the arguments (:func:`fingerprint_of`), another one for the same key
    raises :class:`IdempotencyKeyMismatch`. ``lease`` (s, default ``IDEMPOTENCY_LEASE``): how
    long a running claim keeps others out before it is presumed dead. ``using``: a database."""

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
        if lease is not None:
            lease = conf.LEASE_RANGE.check("idempotent(): lease", lease)
        self.lease = conf.get().IDEMPOTENCY_LEASE if lease is None else lease
        self.using = using or router.db_for_write(store.record_model())
        self.claim: Claim | None = None

    def __enter__(self) -> Claim:
        self.claim = claim(self)
        return self.claim

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
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
    """``with idempotent(key, scope=..., fingerprint=..., lease=...) as claim:`` (see
    :class:`Idempotent`)."""
    return Idempotent(key, scope=scope, fingerprint=fingerprint, lease=lease, using=using)


def claim(
    spec: Idempotent, *, guard: bool = False, finished: bool = False, under: Lock | None = None
) -> Claim:
    """Claim ``spec.key`` race-free (the module docs' protocol). For a claim inside a job's
    transaction (:mod:`.one_commit`): ``guard`` takes the key's guard, and ``under`` a held lock
    its resource guard (:mod:`.guard`), in the same statement; ``finished`` writes the row as it
    will be committed (``succeeded``, no lease), since nobody sees it before the commit."""
    model = store.record_model()
    token = secrets.token_hex(16)
    status = RecordStatus.SUCCEEDED if finished else RecordStatus.RUNNING
    held = current_lock()
    fence = held.fence if held is not None and held.held else None
    resource = held.resource if fence is not None and held is not None else ""
    job_id, job_func, _worker = job_context()

    def claimed(now: datetime) -> dict[str, Any]:  # the columns a claim (or takeover) sets
        return {
            "status": status,
            "token": token,
            "error": "",
            "fence": fence,
            "lock_resource": resource,
            "rq_job_id": job_id,
            "updated_at": now,
            "finished_at": now if finished else None,
            "lease_expires_at": None if finished else now + timedelta(seconds=spec.lease),
            "expires_at": store.expiry(now),  # a takeover too lives a full TTL from now
        }

    def made(record_id: int, attempts: int, fingerprint: str, **extra: Any) -> Claim:
        return Claim(
            spec.key, spec.scope, fingerprint, token, record_id, attempts, spec.using, **extra
        )

    now = timezone.now()
    values: dict[str, Any] = {"scope": spec.scope, "key": spec.key, "created_at": now}
    values.update(fingerprint=spec.fingerprint, **claimed(now))
    lock_key = under.key if guard and under is not None else None
    for _ in range(_TAKEOVER_TRIES):
        found, record_id, row = store.insert_or_read(
            model, spec.using, values, guard=guard, lock_key=lock_key
        )
        if found == store.RESOURCE_GUARDED:
            assert under is not None
            raise refused(under)
        if found == store.INSERTED:
            assert record_id is not None
            return made(record_id, 1, spec.fingerprint)
        if found == store.ABSENT:  # guarded, nothing there: the row is inserted at the end
            return made(0, 1, spec.fingerprint, pending=values)
        if found == store.GUARDED:
            raise store.in_progress(spec.scope, spec.key, "its guard is taken")
        if found != store.EXISTING or row is None:
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
            done = made(
                row["id"], row["attempts"], row["fingerprint"], done=True, result=row["result"]
            )
            duplicate_blocked.send(sender=model, key=spec.key, scope=spec.scope, record=done)
            metrics.count("duplicates_blocked", key_family(spec.key), job_func)
            return done
        now = timezone.now()
        lease_until: datetime | None = row["lease_expires_at"]
        # Claimed under an older holding of the lock we hold now: that holder has lost the lock
        # (we have it, with a larger fence), so its claim is dead whatever its lease says. This
        # is what lets a retry run right after a SIGKILLed work horse.
        superseded = (
            fence is not None
            and row["fence"] is not None
            and row["lock_resource"] == resource
            and row["fence"] < fence
        )
        if (
            row["status"] == RecordStatus.RUNNING
            and lease_until is not None
            and lease_until > now
            and not superseded
        ):
            raise IdempotencyInProgress(
                f"Idempotency key {spec.key!r} (scope {spec.scope!r}) is being processed by "
                f"another claim (attempt {row['attempts']}, lease for another "
                f"{(lease_until - now).total_seconds():.1f}s).",
                key=spec.key,
                scope=spec.scope,
            )
        fingerprint = spec.fingerprint or row["fingerprint"]
        as_read = {name: row[name] for name in ("id", "token", "status", "attempts")}
        taken = (
            model.objects.using(spec.using)
            .filter(**as_read)  # compare-and-set: only if nobody took it over since the read
            .update(attempts=F("attempts") + 1, fingerprint=fingerprint, **claimed(now))
        )
        if taken == 1:
            return made(row["id"], row["attempts"] + 1, fingerprint)
    raise IdempotencyInProgress(
        f"Idempotency key {spec.key!r} (scope {spec.scope!r}) changed hands "
        f"{_TAKEOVER_TRIES} times while claiming; another claim is active.",
        key=spec.key,
        scope=spec.scope,
    )

"""Idempotency claims: an effect is applied once even when a job runs twice.

    with idempotent("refund:R-1", scope="refunds", fingerprint=args) as claim:
        if claim.done:
            return claim.result              # an earlier run succeeded: replay its result
        with transaction.atomic():
            Refund.objects.create(...)       # the business write ...
            claim.succeed({"refund": 42})    # ... and the marker, in the same transaction

The first claimer of a key owns it (insert-or-read, :mod:`.store`). A success is replayed
(``claim.done``); another fingerprint raises :class:`IdempotencyKeyMismatch`, a live lease
:class:`IdempotencyInProgress` (unless claimed under an older fence of the lock held now); a
``failed`` or expired claim is taken over by a compare-and-set. ``succeed()`` writes in the
caller's transaction, only while this claim owns the record (else :class:`IdempotencyClaimLost`);
an exception leaves it ``failed``; no ``succeed()`` succeeds with ``None``. The protocol, leases
and replays: docs/idempotency.md. Needs SQLite >= 3.35 (``RETURNING``)."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.db import DatabaseError, connections, router, transaction
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
from ..logs import logger
from ..signals import duplicate_blocked
from . import inputs, store
from .inputs import (
    check_result,
    fingerprint_of,
    key_family,
    storable_error,
    validate_key,
    validate_scope,
)
from .resource_guard import refused

__all__ = ["Claim", "Idempotent", "claim", "fingerprint_of", "idempotent"]

_TAKEOVER_TRIES = 5

# The tasks ending claims whose ``async with`` was cancelled (see Idempotent.__aenter__): held
# here until done, as the event loop keeps only weak references to its tasks.
_ending: set[asyncio.Task[None]] = set()


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
    # PostgreSQL, in a job's transaction: the row to insert at the end (record_id 0 until then).
    pending: dict[str, Any] | None = field(default=None, repr=False)
    _succeed_called: bool = field(default=False, repr=False)
    _committed: bool = field(default=False, repr=False)

    def succeed(self, result: Any = None) -> None:
        """Record success with ``result`` (JSON) in the current transaction.
        :class:`IdempotencyError` on a replayed claim or a result that is not JSON."""
        if self.done:
            why = "was already done; nothing to record."
            raise inputs.error_for(IdempotencyError, self.key, self.scope, why)
        check_result(result, key=self.key, scope=self.scope)
        expires_at = store.expiry(timezone.now())
        if self._finish(RecordStatus.SUCCEEDED, result=result, expires_at=expires_at) != 1:
            why = "was taken over by another claim; this success was not recorded."
            raise inputs.error_for(IdempotencyClaimLost, self.key, self.scope, why)
        self._succeed_called = True
        self.result = result
        transaction.on_commit(lambda: setattr(self, "_committed", True), using=self.using)

    async def asucceed(self, result: Any = None) -> None:
        """:meth:`succeed` from async code, as Django's async ORM runs queries
        (``sync_to_async``, thread-sensitive: in the transaction the claim was made in)."""
        await sync_to_async(self.succeed)(result)

    def _finish(self, status: RecordStatus, error: str = "", **fields: Any) -> int:
        """Finish this claim's record now, only while this claim still owns it."""
        now = timezone.now()
        mine = store.record_model().objects.using(self.using)
        mine = mine.filter(pk=self.record_id, token=self.token, status=RecordStatus.RUNNING)
        ended = {"finished_at": now, "updated_at": now, "lease_expires_at": None}
        error = storable_error(error, 10_000)
        return int(mine.update(status=status, error=error, **ended, **fields))

    def _fail(self, exc: BaseException) -> None:
        """Record the block's exception ``exc`` (status ``failed``, its text), never replacing
        it: the caller sees ``exc`` whatever happens here.

        Inside a transaction that ``exc`` broke (Django runs no query until its ``atomic`` block
        ends: an ``IntegrityError`` under ``ATOMIC_REQUESTS``), nothing is written; that
        transaction rolls back, and the claim made in it with it. A write that fails (the
        transaction aborted by raw SQL on PostgreSQL, the database gone) is logged; the record
        keeps its lease, which then decides when a retry may run."""
        connection = connections[self.using]
        if connection.in_atomic_block and connection.needs_rollback:
            return
        try:
            self._finish(RecordStatus.FAILED, f"{type(exc).__name__}: {exc}")
        except DatabaseError:
            message = "could not record the failure of idempotency key %r (scope %r)"
            logger.warning(message, self.key, self.scope, exc_info=True)

    def end(self, exc: BaseException | None) -> None:
        """Leave the block: a success recorded, or committing with an enclosing one, stays."""
        if self.done:
            return
        if exc is not None:
            self._fail(exc)
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
        self.key = validate_key(key)
        self.scope = validate_scope(scope)
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

    async def __aenter__(self) -> Claim:
        """``async with idempotent(key) as claim:``: the claim's queries run as Django's async
        ORM runs its own (``sync_to_async``, thread-sensitive), so the block's
        ``await claim.asucceed(...)`` and the end of the block use the same connection.

        Cancelled meanwhile, it re-raises ``CancelledError``; the claim, which goes on in its
        thread, is then ended as the block's failure would be (a retry runs at once), never
        left running until its lease runs out."""
        claiming = asyncio.ensure_future(sync_to_async(self.__enter__)())
        try:
            return await asyncio.shield(claiming)
        except asyncio.CancelledError:
            ending = asyncio.ensure_future(self._end_when_claimed(claiming))
            _ending.add(ending)
            ending.add_done_callback(_ending.discard)
            await asyncio.shield(ending)  # cancelled again, the ending still goes on
            raise

    async def _end_when_claimed(self, claiming: asyncio.Future[Claim]) -> None:
        """Wait for ``claiming`` (a claim whose ``async with`` was cancelled), then end the
        claim it made as a block cancelled at its start: recorded failed (a replay or a claim
        that raised needs nothing)."""
        try:
            await claiming
        except Exception:  # noqa: BLE001 - no claim was made: nothing to end
            return
        cancelled = asyncio.CancelledError("cancelled while claiming the key")
        await sync_to_async(self.__exit__)(type(cancelled), cancelled, None)

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        await sync_to_async(self.__exit__)(exc_type, exc, tb)


#: ``with idempotent(key, scope=..., fingerprint=..., lease=...) as claim:``, the public name.
def idempotent(
    key: str,
    *,
    scope: str = "",
    fingerprint: Any = None,
    lease: float | None = None,
    using: str | None = None,
) -> Idempotent:
    """An :class:`Idempotent` block for ``key``: ``with idempotent("refund:R-1") as claim:``
    runs the block once per key (a replay returns the stored result in ``claim``).

    ``key``: the effect's idempotency key (at most 255 characters). ``scope``: a namespace for
    keys (a job's dotted name, for ``@locked_job``). ``fingerprint``: a value describing the
    arguments; another one for the same key raises :class:`IdempotencyKeyMismatch`. ``lease``
    (s, default ``JOBLOCK["IDEMPOTENCY_LEASE"]``): how long a running claim keeps others out
    before it is presumed dead. ``using``: the database alias (default: the database router's
    choice for the record).
    Raises ``ValueError`` for a bad key, scope or lease."""
    return Idempotent(key, scope=scope, fingerprint=fingerprint, lease=lease, using=using)


def claim(
    spec: Idempotent, *, guard: bool = False, finished: bool = False, under: Lock | None = None
) -> Claim:
    """Claim ``spec.key`` race-free. In a job's transaction (:mod:`.one_commit`) ``guard`` takes
    the key's guard and ``under``'s resource guard in the same statement, and ``finished`` writes
    the row as it will commit (``succeeded``, no lease): nobody sees it before the commit."""
    model = store.record_model()
    claimant = _Claimant.start(spec, finished=finished)
    values = claimant.new_row(timezone.now())
    lock_key = under.key if guard and under is not None else None
    for _ in range(_TAKEOVER_TRIES):
        found, pk, row = store.insert_or_read(
            model, spec.using, values, guard=guard, lock_key=lock_key
        )
        if found == store.RESOURCE_GUARDED:
            assert under is not None
            raise refused(under)
        if found == store.INSERTED:
            assert pk is not None
            return claimant.made(pk, 1, spec.fingerprint)
        if found == store.ABSENT:  # guarded, nothing there: the row is inserted at the end
            return claimant.made(0, 1, spec.fingerprint, pending=values)
        if found == store.GUARDED:
            raise store.in_progress(spec.scope, spec.key, "its guard is taken")
        if found != store.EXISTING or row is None:
            continue  # purged, or committed just too late for that statement: ask again
        taken = _claim_existing(model, claimant, row)
        if taken is not None:
            return taken
    why = f"changed hands {_TAKEOVER_TRIES} times while claiming; another claim is active."
    raise inputs.error_for(IdempotencyInProgress, spec.key, spec.scope, why)


@dataclass(frozen=True)
class _Claimant:
    """One call of :func:`claim`: who claims, and what its insert or takeover of the row writes."""

    spec: Idempotent
    finished: bool  # write the row as it will commit (succeeded, no lease): see claim()
    token: str  # this claim's own, in the row while the claim owns it
    fence: int | None  # the fence of the lock held now (None: none held) ...
    resource: str  # ... and its resource ("" when none)
    job_id: str  # the RQ job claiming ("" outside a job)
    job_func: str

    @classmethod
    def start(cls, spec: Idempotent, *, finished: bool) -> _Claimant:
        """A new claimant of ``spec``: a fresh token, the lock held now and the job running now."""
        token = secrets.token_hex(16)
        fence, resource = _lock_held_now()
        job_id, job_func, _worker = job_context()
        return cls(spec, finished, token, fence, resource, job_id, job_func)

    def columns(self, now: datetime) -> dict[str, Any]:
        """The columns a claim or a takeover at ``now`` sets: this claim as the owner, under the
        lock held now, with its lease; a takeover too lives a full TTL from ``now``."""
        return {
            "status": RecordStatus.SUCCEEDED if self.finished else RecordStatus.RUNNING,
            "token": self.token,
            "error": "",
            "rq_job_id": store.cut_job_id(store.record_model(), self.job_id),
            "fence": self.fence,
            "lock_resource": self.resource,
            "lease_expires_at": None if self.finished else now + timedelta(seconds=self.spec.lease),
            "updated_at": now,
            "finished_at": now if self.finished else None,
            "expires_at": store.expiry(now),
        }

    def new_row(self, now: datetime) -> dict[str, Any]:
        """The row a first claim at ``now`` inserts: the key, its arguments and :meth:`columns`."""
        return {
            "scope": self.spec.scope,
            "key": self.spec.key,
            "created_at": now,
            "fingerprint": self.spec.fingerprint,
            **self.columns(now),
        }

    def made(
        self,
        pk: int,
        attempts: int,
        fingerprint: str,
        *,
        done: bool = False,
        result: Any = None,
        pending: dict[str, Any] | None = None,
    ) -> Claim:
        """The :class:`Claim` of row ``pk`` (0: ``pending``, inserted at the end) for ``spec``."""
        spec = self.spec
        return Claim(
            spec.key,
            spec.scope,
            fingerprint,
            self.token,
            pk,
            attempts,
            spec.using,
            done=done,
            result=result,
            pending=pending,
        )

    def supersedes(self, row: store.Row) -> bool:
        """Whether ``row`` was claimed under an older holding of the lock held now: that holder
        has lost the lock, so its claim is dead whatever its lease says (a retry runs right after
        a SIGKILL)."""
        if self.fence is None or row["lock_resource"] != self.resource:
            return False
        return row["fence"] is not None and row["fence"] < self.fence


def _lock_held_now() -> tuple[int | None, str]:
    """The fence and the resource of the lock held now in this context; ``(None, "")`` when
    none is held (or it has no fence). The fence is None for a lock with several holders
    (``limit`` > 1): they hold it at once, so an older fence is no proof that its holder is
    gone, and its claim is not superseded (:meth:`Claim.supersedes`)."""
    held = current_lock()
    if held is None or not held.held or held.fence is None:
        return None, ""
    if held.limit > 1:
        return None, held.resource
    return held.fence, held.resource


def _claim_existing(model: Any, claimant: _Claimant, row: store.Row) -> Claim | None:
    """Claim the key of the existing ``row`` (as read): replay its success, or take over a
    ``failed``, expired or superseded claim. :class:`IdempotencyKeyMismatch` for another
    fingerprint, :class:`IdempotencyInProgress` for a live lease; None when another claim took
    the row over since it was read (ask again)."""
    spec = claimant.spec
    if spec.fingerprint and row["fingerprint"] and row["fingerprint"] != spec.fingerprint:
        why = (
            f"was used with other arguments (fingerprint {row['fingerprint'][:12]}..., "
            f"now {spec.fingerprint[:12]}...)."
        )
        raise inputs.error_for(IdempotencyKeyMismatch, spec.key, spec.scope, why)
    if row["status"] == RecordStatus.SUCCEEDED:
        return _replay(model, claimant, row)
    now = timezone.now()
    lease_until: datetime | None = row["lease_expires_at"]
    if row["status"] == RecordStatus.RUNNING and lease_until is not None:
        if lease_until > now and not claimant.supersedes(row):
            left = (lease_until - now).total_seconds()
            why = (
                f"is being processed by another claim (attempt {row['attempts']}, "
                f"lease {left:.1f}s more)."
            )
            raise inputs.error_for(IdempotencyInProgress, spec.key, spec.scope, why)
    return _take_over(model, claimant, row, now)


def _replay(model: Any, claimant: _Claimant, row: store.Row) -> Claim:
    """The done claim replaying the success of ``row``, announced by :data:`duplicate_blocked`
    and counted in the ``duplicates_blocked`` metric."""
    spec = claimant.spec
    done = claimant.made(
        row["id"], row["attempts"], row["fingerprint"], done=True, result=row["result"]
    )
    duplicate_blocked.send(sender=model, key=spec.key, scope=spec.scope, record=done)
    metrics.count("duplicates_blocked", key_family(spec.key), claimant.job_func)
    return done


def _take_over(model: Any, claimant: _Claimant, row: store.Row, now: datetime) -> Claim | None:
    """Take the claim of ``row`` over at ``now`` by a compare-and-set: only if nobody changed
    the row since it was read (else None). One more attempt; the row keeps its fingerprint
    unless the claimant has one."""
    spec = claimant.spec
    fingerprint = spec.fingerprint or row["fingerprint"]
    as_read = {name: row[name] for name in ("id", "token", "status", "attempts")}
    again = model.objects.using(spec.using).filter(**as_read)
    taken = again.update(
        attempts=F("attempts") + 1, fingerprint=fingerprint, **claimant.columns(now)
    )
    if taken != 1:
        return None
    return claimant.made(row["id"], row["attempts"] + 1, fingerprint)

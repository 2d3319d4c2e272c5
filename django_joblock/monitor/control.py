"""Operator actions on locks: audited force release and reaping of dead holders. Never a blind
``DEL``: the owner's own compare-and-delete against the owner the operator was shown. Every
attempt leaves an append-only ``LockAudit`` row, a release a note so the holder reports
"released by an operator". A Redis that does not answer fails within seconds (short timeouts,
no retries), audited with whether the release may have happened. See docs/admin.md."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import Any

from .. import conf, metrics
from ..backend import REDIS_ERRORS, client, unavailable
from ..choices import AuditAction
from ..locks import index, notes, waiting
from ..locks.info import LockHash
from ..locks.keys import MAX_LIMIT, LockKeys, is_owner_hash, owner_hash, validate_resource
from ..locks.scripts import Outcome
from ..models import LockAudit
from .active import active_locks
from .health import Health, holder_health


@dataclass
class ReleaseResult:
    released: bool
    outcome: str
    audit: Any


MAX_REASON = 2000  # characters of a force-release reason


def validate_slot(what: str, slot: object) -> int:
    """``slot`` if it is an int in 0..:data:`MAX_LIMIT` - 1 (which holder of a lock with
    ``limit=N``; 0 for a plain lock), else ``ValueError`` naming ``what``."""
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < MAX_LIMIT:
        raise ValueError(
            f"{what} must be an int in 0..{MAX_LIMIT - 1} (the slot of one holder of a lock "
            f"with a limit, as joblock_locks shows it; 0 for a plain lock), got {slot!r}."
        )
    return slot


def force_release(
    resource: str,
    *,
    reason: str,
    owner: str | None = None,
    token: str | None = None,
    slot: int = 0,
    user: Any = None,
    actor: str = "",
    action: AuditAction = AuditAction.FORCE_RELEASE,
    renewed_ms: int | None = None,
) -> ReleaseResult:
    """Release ``resource``'s lock (compare-and-delete, never a blind ``DEL``) and audit it: a
    :class:`LockAudit` row whatever happened, and a note the holder reads when it finds the
    lock lost.

    ``reason``: why (required, at most :data:`MAX_REASON` characters).

    ``owner`` / ``token``: release only if still held by this holder (``owner``: the token's
    12-character hash, as pages and logs show it); neither: whoever holds it now.

    ``slot``: which holder of a lock with ``limit=N`` (0..N-1, as ``joblock_locks`` and the
    dashboard show it); only that slot's holding is released, the other holders keep theirs.
    The audit row's ``holder`` details name it (``"slot"``). 0, the default, is a plain lock's.

    ``user`` / ``actor``: who asked (a Django user, or a name such as a command's).

    ``action``: what the audit row calls it (a force release, or a reap of a dead holder).

    ``renewed_ms``: the holder's last renewal (Redis server ms) when it was judged dead: a lock
    renewed since is refused.

    Raises ``ValueError`` for an empty reason, one too long or holding NUL, a bad resource,
    owner or slot, or both ``owner`` and ``token``; :class:`LockBackendUnavailable`, audited,
    when Redis does not answer."""
    resource = validate_resource(resource)
    reason = _checked_reason(reason)
    slot = validate_slot("slot", slot)
    wanted = _wanted_owner(owner, token)
    actor = actor or (getattr(user, "get_username", lambda: "")() if user else "")
    actor = actor.replace("\x00", "")[:150]  # LockAudit.actor
    keys = LockKeys(conf.get().KEY_PREFIX, resource, slot)
    redis = client()  # short timeouts, no retries

    def audit(found: LockHash | None, released: bool, outcome: str) -> Any:
        return LockAudit.objects.create(
            action=action,
            resource=resource,
            owner=found.owner if found is not None else wanted or "",
            fence=found.fence if found is not None else None,
            holder=_audited_holder(found, slot),
            reason=reason,
            released=released,
            outcome=outcome[:200],
            user=user if getattr(user, "pk", None) else None,
            actor=actor,
        )

    try:
        found = LockHash.decode(redis.hgetall(keys.lock))
    except REDIS_ERRORS as exc:
        error = unavailable(exc, "read the lock", resource=resource, key=keys.lock, owner="")
        audit(None, False, f"not released: Redis did not answer reading the lock ({exc})")
        raise error from exc
    released = False
    note: notes.OperatorRelease | None = None
    if found is None:
        outcome = "refused: no such lock (expired or released already)"
    elif wanted is not None and wanted != found.owner:
        outcome = f"refused: the lock changed owner (now {found.owner}, expected {wanted})"
    elif renewed_ms is not None and (found.renewed_ms or 0) > renewed_ms:
        outcome = "refused: renewed since its holder was judged dead (it is alive)"
    else:
        note = notes.OperatorRelease(found.owner, action, actor, reason)
        try:
            released = _release(redis, keys, found, note)
        except REDIS_ERRORS as exc:
            error = unavailable(
                exc, "release the lock", resource=resource, key=keys.lock, owner=found.owner
            )
            audit(
                found,
                False,
                "unknown: Redis did not answer the release, so the lock may or may not have "
                f"been released ({exc})",
            )
            raise error from exc
        outcome = "released" if released else "refused: the lock changed owner or expired"
        if released:
            metrics.count("forced_releases", keys.family, found.job_func)
            metrics.flush_now()
    row = audit(found, released, outcome)
    if released and note is not None:
        with contextlib.suppress(*REDIS_ERRORS):  # else the note only lacks the audit id
            redis.set(keys.released, replace(note, audit=row.pk).encode(), xx=True, keepttl=True)
    return ReleaseResult(released, outcome, row)


def _checked_reason(reason: str) -> str:
    """``reason`` stripped, or ``ValueError`` when it is empty, holds NUL or is too long."""
    reason = (reason or "").strip()
    if not reason:
        raise ValueError("A reason is required to force-release a lock.")
    if "\x00" in reason:  # checked before the release: the audit row could not be written
        raise ValueError("The reason contains a NUL character, which the audit log cannot keep.")
    if len(reason) > MAX_REASON:  # an audit log of readable reasons, not of pasted dumps
        raise ValueError(
            f"The reason is {len(reason)} characters long; at most {MAX_REASON} are kept."
        )
    return reason


def _audited_holder(found: LockHash | None, slot: int) -> dict[str, str]:
    """What an audit row keeps of the holder: its details and, for a lock with a limit or a
    release asked of a slot other than 0, which slot (``"slot"``, as text like the rest)."""
    details = found.details() if found is not None else {}
    if slot or (found is not None and found.limit > 1):
        details["slot"] = str(slot)
    return details


def _wanted_owner(owner: str | None, token: str | None) -> str | None:
    if owner is not None and token is not None:
        raise ValueError("Give the owner's hash or its token, not both.")
    if token is not None:
        return owner_hash(token)
    if owner is not None and not is_owner_hash(owner):
        raise ValueError(
            f"owner must be a 12-character owner hash as joblock_locks and the dashboard show "
            f"it (pass a token as token=), got {owner[:40]!r}."
        )
    return owner


def _release(redis: Any, keys: LockKeys, found: LockHash, note: notes.OperatorRelease) -> bool:
    """The owner's own release (which hands the lock to the first live waiter, see
    :func:`waiting.release`) with the removal of its index entry, the note written just before
    so that a holder noticing the loss always finds it; taken back if nothing was released."""
    encoded = note.encode()
    redis.set(keys.released, encoded, px=notes.ttl_ms(found.ttl_ms))
    # Entries are per owner: if the lock is gone or another's, this entry is stale anyway.
    unindex = index.remove_call(keys.prefix, keys.resource, found.owner, found.job_id, keys.slot)
    outcome, _ = waiting.release(redis, keys, found.token, "", [unindex])
    if outcome is Outcome.OK:
        return True
    if redis.get(keys.released) == encoded.encode():
        redis.delete(keys.released)
    return False


def _reap_reason(evidence: str) -> str:
    """The reason a reap records: ``holder dead:`` and the evidence, cut to
    :data:`MAX_REASON` characters (the evidence names RQ job ids and worker names, which have
    no length limit; a long one must not stop the reap of this lock or of the next)."""
    reason = f"holder dead: {evidence}".replace("\x00", "")
    if len(reason) > MAX_REASON:
        reason = reason[: MAX_REASON - 1] + "…"
    return reason


def reap(*, dry_run: bool = False, actor: str = "joblock_reap") -> list[tuple[str, str]]:
    """Release the locks whose holder is dead (see :mod:`health`), unless renewed since: each
    dead holder's own slot of a lock with a limit, never its live neighbours'. Returns
    ``[(what, outcome)]`` of those it acted on (or would, with ``dry_run``); ``what`` is the
    resource, with the slot for a lock with a limit (:attr:`ActiveLock.label`). Raises
    :class:`LockBackendUnavailable` when Redis does not answer."""
    rows = active_locks(limit=10_000)
    release = functools.partial(force_release, actor=actor, action=AuditAction.REAP)
    done = []
    for row, health in zip(rows, holder_health(rows), strict=True):
        why = _reap_reason(health.why)
        if health.state is Health.DEAD and dry_run:
            done.append((row.label, f"would release ({why})"))
        elif health.state is Health.DEAD:
            result = release(
                row.resource,
                owner=row.owner,
                slot=row.slot,
                reason=why,
                renewed_ms=row.renewed_ms,
            )
            done.append((row.label, result.outcome))
    return done

"""Operator actions on locks: audited force release and reaping of dead holders.

Never a blind ``DEL``: the lock is released with the same compare-and-delete script its owner
would use, against the token of the owner the operator was shown. A lock that changed hands
in between is refused. Every attempt, refused or not, leaves an append-only
:class:`~django_joblock.models.LockAudit` row. A release also leaves a short-lived note for the
holder (see :mod:`django_joblock.locks.notes`), so its job reports "released by an operator"
with the audit id instead of "expired".

Operator actions use the locks' own client (short socket timeouts, no retries): a Redis that
does not answer gives :class:`~django_joblock.exceptions.LockBackendUnavailable` within
seconds (audited, with whether the release may have happened), never a page hanging for a
minute or a raw ``TimeoutError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import conf, metrics
from ..backend import REDIS_ERRORS, client, unavailable
from ..choices import AuditAction
from ..locks import index, notes, waiting
from ..locks.info import LockHash, LockInfo, info, read_many
from ..locks.keys import LockKeys, is_owner_hash, owner_hash, validate_resource
from ..locks.scripts import Outcome
from .active import active_locks
from .health import DEAD, lock_health


def operator_client() -> Any:
    """The locks' client of ``REDIS_ALIAS`` (short timeouts, no retries)."""
    return client(conf.get().REDIS_ALIAS)


@dataclass
class ReleaseResult:
    released: bool
    outcome: str
    audit: Any


def holder(resource: str) -> LockInfo | None:
    """The current holder of ``resource``'s lock, or None (one read on the operator client).

    Raises :class:`LockBackendUnavailable` when Redis does not answer.
    """
    resource = validate_resource(resource)
    try:
        ((found, pttl, server_ms),) = read_many(operator_client(), [resource])
    except REDIS_ERRORS as exc:
        key = LockKeys(conf.get().KEY_PREFIX, resource).lock
        raise unavailable(exc, "read the lock", resource=resource, key=key, owner="") from exc
    return None if found is None else info(resource, found, pttl, server_ms)


def force_release(
    resource: str,
    *,
    reason: str,
    owner: str | None = None,
    token: str | None = None,
    user: Any = None,
    actor: str = "",
    action: AuditAction = AuditAction.FORCE_RELEASE,
    renewed_ms: int | None = None,
) -> ReleaseResult:
    """Release ``resource``'s lock if it is still held by ``owner`` (the token's 12-character
    hash, as pages and logs show it) or by ``token`` (the owner's secret itself).

    Neither releases whoever holds it *now* (still a compare-and-delete against the token just
    read). With ``renewed_ms`` (the holder's last renewal as seen when it was judged
    dead), a lock renewed since then is refused: its holder is alive.

    Raises ``ValueError`` for an empty reason, a bad resource, an ``owner`` that is not such a
    hash, or both ``owner`` and ``token``, and
    :class:`LockBackendUnavailable` when Redis does not answer (after auditing the attempt).
    """
    resource = validate_resource(resource)
    reason = (reason or "").strip()
    if not reason:
        raise ValueError("A reason is required to force-release a lock.")
    actor = actor or (getattr(user, "get_username", lambda: "")() if user else "")
    keys = LockKeys(conf.get().KEY_PREFIX, resource)
    redis = operator_client()
    wanted = _wanted_owner(owner, token)
    try:
        found = LockHash.decode(redis.hgetall(keys.lock))
    except REDIS_ERRORS as exc:
        error = unavailable(exc, "read the lock", resource=resource, key=keys.lock, owner="")
        outcome = f"not released: Redis did not answer reading the lock ({exc})"
        _audit(resource, wanted or "", None, reason, False, outcome, user, actor, action)
        raise error from exc
    current = found.owner if found is not None else ""
    released, note = False, None
    if found is None:
        outcome = "refused: no such lock (expired or released already)"
    elif wanted is not None and wanted != current:
        outcome = f"refused: the lock changed owner (now {current}, expected {wanted})"
    elif renewed_ms is not None and (found.renewed_ms or 0) > renewed_ms:
        outcome = "refused: renewed since its holder was judged dead (it is alive)"
    else:
        note = notes.OperatorRelease(current, action, actor, reason)
        try:
            released = _release(redis, keys, found.token, note, found.ttl_ms)
        except REDIS_ERRORS as exc:
            error = unavailable(
                exc, "release the lock", resource=resource, key=keys.lock, owner=current
            )
            outcome = (
                "unknown: Redis did not answer the release, so the lock may or may not have "
                f"been released ({exc})"
            )
            _audit(resource, current, found, reason, False, outcome, user, actor, action)
            raise error from exc
        outcome = "released" if released else "refused: the lock changed owner or expired"
        if released:
            metrics.count("forced_releases", keys.family, found.job_func)
            metrics.flush_now()
    audit = _audit(
        resource, current or (wanted or ""), found, reason, released, outcome, user, actor, action
    )
    if released and note is not None:
        _add_audit_id(redis, keys, note, audit.pk)
    return ReleaseResult(released, outcome, audit)


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


def _release(
    redis: Any, keys: LockKeys, token: str, note: notes.OperatorRelease, ttl: int | None
) -> bool:
    """Compare-and-delete with the owner's own release (which hands the lock to the first
    live waiter in line, see :func:`waiting.release`) and the removal of its index entry, the
    note written just before it so that a holder noticing the loss always finds it; when
    nothing was released the note is taken back."""
    encoded = note.encode()
    redis.set(keys.released, encoded, px=notes.ttl_ms(ttl))
    # Entries are per owner: if the lock is found gone or another's, this one is stale anyway.
    unindex = index.remove_call(keys.prefix, keys.resource, owner_hash(token))
    outcome, _ = waiting.release(redis, keys, token, "", [unindex])
    if outcome is not Outcome.OK:
        if redis.get(keys.released) == encoded.encode():
            redis.delete(keys.released)  # nothing was released: no note about it
        return False
    return True


def _add_audit_id(redis: Any, keys: LockKeys, note: notes.OperatorRelease, audit_id: int) -> None:
    noted = notes.OperatorRelease(note.owner, note.action, note.actor, note.reason, audit_id)
    try:
        redis.set(keys.released, noted.encode(), xx=True, keepttl=True)
    except REDIS_ERRORS:
        pass  # the note still says who released it, only without the audit id


def _audit(
    resource: str,
    owner: str,
    found: LockHash | None,
    reason: str,
    released: bool,
    outcome: str,
    user: Any,
    actor: str,
    action: AuditAction,
) -> Any:
    from ..models import LockAudit

    return LockAudit.objects.create(
        action=action,
        resource=resource,
        owner=owner,
        fence=found.fence if found is not None else None,
        holder=found.details() if found is not None else {},
        reason=reason,
        released=released,
        outcome=outcome[:200],
        user=user if getattr(user, "pk", None) else None,
        actor=actor,
    )


def reap(*, dry_run: bool = False, actor: str = "joblock_reap") -> list[tuple[str, str]]:
    """Release the locks whose holder is dead (see :mod:`health`); leave live ones alone.

    Returns ``[(resource, outcome)]`` for the locks it acted on (or would, with ``dry_run``).
    Each release is refused if the lock was renewed after it was judged dead. Raises
    :class:`LockBackendUnavailable` when Redis does not answer.
    """
    rows = active_locks(limit=10_000)
    health = lock_health(rows)
    done = []
    for active in rows:
        state = health.get(active.resource)
        if state is None or state.state is not DEAD:
            continue
        if dry_run:
            done.append((active.resource, f"would release (holder dead: {state.why})"))
            continue
        result = force_release(
            active.resource,
            owner=active.owner,
            actor=actor,
            action=AuditAction.REAP,
            reason=f"holder dead: {state.why}",
            renewed_ms=active.renewed_ms,
        )
        done.append((active.resource, result.outcome))
    return done

"""Operator actions on locks: audited force release and reaping of dead holders.

Never a blind ``DEL``: the lock is released with the same compare-and-delete script its owner
would use, against the token of the owner the operator was shown. A lock that changed hands
in between is refused. Every attempt, refused or not, leaves an append-only
:class:`~django_joblock.models.LockAudit` row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import conf, lua, metrics
from .backend import connection
from .health import DEAD, lock_health
from .keys import LockKeys, index_member, owner_hash, validate_resource
from .monitoring import _text, active_locks


@dataclass
class ReleaseResult:
    released: bool
    outcome: str
    audit: Any


def force_release(
    resource: str,
    *,
    reason: str,
    owner: str | None = None,
    user: Any = None,
    actor: str = "",
    action: str = "force_release",
) -> ReleaseResult:
    """Release ``resource``'s lock if it is still held by ``owner`` (a token or its hash).

    ``owner=None`` releases whoever holds it *now* (still a compare-and-delete against the
    token just read). Raises ``ValueError`` for an empty reason or a bad resource.
    """
    from .models import LockAudit

    resource = validate_resource(resource)
    reason = (reason or "").strip()
    if not reason:
        raise ValueError("A reason is required to force-release a lock.")
    prefix = conf.get().KEY_PREFIX
    keys = LockKeys(prefix, resource)
    client = connection(conf.get().REDIS_ALIAS)
    raw = {_text(k): _text(v) for k, v in client.hgetall(keys.lock).items()}
    token = raw.get("token", "")
    current = owner_hash(token) if token else ""
    wanted = None if owner is None else (owner if len(owner) == 12 else owner_hash(owner))
    released = False
    if not token:
        outcome = "refused: no such lock (expired or released already)"
    elif wanted is not None and wanted != current:
        outcome = f"refused: the lock changed owner (now {current}, expected {wanted})"
    else:
        code = lua.Outcome(lua.run(client, lua.RELEASE_SHA, [keys.lock], [token]))
        released = code is lua.Outcome.OK
        outcome = "released" if released else f"refused: {code.reason}"
        if released:
            client.zrem(keys.index, index_member(resource, current))
            metrics.count("forced_releases", keys.family, raw.get("job_func", ""))
            metrics.flush_now()
    holder = {
        name: raw[name]
        for name in (
            "host",
            "pid",
            "job_id",
            "job_func",
            "worker",
            "acquired_ms",
            "renewed_ms",
            "renewals",
            "ttl_ms",
        )
        if name in raw
    }
    audit = LockAudit.objects.create(
        action=action,
        resource=resource,
        owner=current or (wanted or ""),
        fence=int(raw["fence"]) if raw.get("fence") else None,
        holder=holder,
        reason=reason,
        released=released,
        outcome=outcome,
        user=user if getattr(user, "pk", None) else None,
        actor=actor or (getattr(user, "get_username", lambda: "")() if user else ""),
    )
    return ReleaseResult(released, outcome, audit)


def reap(*, dry_run: bool = False, actor: str = "joblock_reap") -> list[tuple[str, str]]:
    """Release the locks whose holder is dead (see :mod:`health`); leave live ones alone.

    Returns ``[(resource, outcome)]`` for the locks it acted on (or would, with ``dry_run``).
    """
    held = active_locks(limit=10_000)
    health = lock_health(held)
    done = []
    for lock in held:
        if health.get(lock.resource) != DEAD:
            continue
        if dry_run:
            done.append((lock.resource, "would release (holder dead)"))
            continue
        result = force_release(
            lock.resource,
            owner=lock.owner,
            actor=actor,
            action="reap",
            reason="holder dead: its RQ job, worker or process is gone",
        )
        done.append((lock.resource, result.outcome))
    return done

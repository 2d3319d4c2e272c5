"""Operator actions on locks: audited force release and reaping of dead holders.

Never a blind ``DEL``: the lock is released with the same compare-and-delete script its owner
would use, against the token of the owner the operator was shown. A lock that changed hands
in between is refused. Every attempt, refused or not, leaves an append-only
:class:`~django_joblock.models.LockAudit` row. A release also leaves a short-lived note for the
holder (see :mod:`django_joblock.tombstones`), so its job reports "released by an operator"
with the audit id instead of "expired".

Operator actions talk to Redis with short socket timeouts (``OPERATOR_TIMEOUT``) and no
client-side retries: a Redis that does not answer gives
:class:`~django_joblock.exceptions.LockBackendUnavailable` within seconds (audited, with
whether the release may have happened), never a page hanging for a minute or a raw
``TimeoutError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import conf, lua, metrics, tombstones, waiting
from .backend import REDIS_ERRORS, connection, renewal_client, unavailable
from .health import DEAD, lock_health
from .keys import LockKeys, index_member, owner_hash, validate_resource
from .monitoring import active_locks, decode

OPERATOR_TIMEOUT = 2.0  # seconds, per Redis command of an operator action
HOLDER_FIELDS = (
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

_clients: dict[int, tuple[Any, Any]] = {}


def operator_client() -> Any:
    """A client on the lock Redis with short timeouts and no retries (one per connection)."""
    base = connection(conf.get().REDIS_ALIAS)
    found = _clients.get(id(base))
    if found is None or found[0] is not base:
        found = _clients[id(base)] = (base, renewal_client(base, OPERATOR_TIMEOUT))
    return found[1]


@dataclass
class ReleaseResult:
    released: bool
    outcome: str
    audit: Any


def holder(resource: str) -> dict[str, Any] | None:
    """The current holder of ``resource``'s lock, or None: ``owner`` (hash), ``fence``, the
    holder details and ``held_for`` (seconds, on the lock server's clock).

    Raises :class:`LockBackendUnavailable` when Redis does not answer.
    """
    keys = LockKeys(conf.get().KEY_PREFIX, validate_resource(resource))
    try:
        pipe = operator_client().pipeline(transaction=False)
        pipe.time()
        pipe.hgetall(keys.lock)
        clock, reply = pipe.execute()
    except REDIS_ERRORS as exc:
        raise unavailable(exc, "read the lock", resource=resource, key=keys.lock, owner="") from exc
    raw = {decode(k): decode(v) for k, v in reply.items()}
    if not raw.get("token"):
        return None
    found: dict[str, Any] = {name: raw[name] for name in (*HOLDER_FIELDS, "fence") if name in raw}
    found["owner"] = owner_hash(raw["token"])
    now_ms = int(clock[0]) * 1000 + int(clock[1]) // 1000
    acquired = int(raw.get("acquired_ms") or now_ms)
    found["held_for"] = max(0.0, (now_ms - acquired) / 1000)
    return found


def force_release(
    resource: str,
    *,
    reason: str,
    owner: str | None = None,
    user: Any = None,
    actor: str = "",
    action: str = "force_release",
    renewed_ms: int | None = None,
) -> ReleaseResult:
    """Release ``resource``'s lock if it is still held by ``owner`` (a token or its hash).

    ``owner=None`` releases whoever holds it *now* (still a compare-and-delete against the
    token just read). With ``renewed_ms`` (the holder's last renewal as seen when it was judged
    dead), a lock renewed since then is refused: its holder is alive.

    Raises ``ValueError`` for an empty reason or a bad resource, and
    :class:`LockBackendUnavailable` when Redis does not answer (after auditing the attempt).
    """
    resource = validate_resource(resource)
    reason = (reason or "").strip()
    if not reason:
        raise ValueError("A reason is required to force-release a lock.")
    actor = actor or (getattr(user, "get_username", lambda: "")() if user else "")
    prefix = conf.get().KEY_PREFIX
    keys = LockKeys(prefix, resource)
    client = operator_client()
    wanted = None if owner is None else (owner if len(owner) == 12 else owner_hash(owner))
    try:
        raw = {decode(k): decode(v) for k, v in client.hgetall(keys.lock).items()}
    except REDIS_ERRORS as exc:
        error = unavailable(exc, "read the lock", resource=resource, key=keys.lock, owner="")
        outcome = f"not released: Redis did not answer reading the lock ({exc})"
        _audit(resource, wanted or "", {}, reason, False, outcome, user, actor, action)
        raise error from exc
    token = raw.get("token", "")
    current = owner_hash(token) if token else ""
    released, note = False, None
    if not token:
        outcome = "refused: no such lock (expired or released already)"
    elif wanted is not None and wanted != current:
        outcome = f"refused: the lock changed owner (now {current}, expected {wanted})"
    elif renewed_ms is not None and int(raw.get("renewed_ms") or 0) > renewed_ms:
        outcome = "refused: renewed since its holder was judged dead (it is alive)"
    else:
        note = tombstones.OperatorRelease(current, action, actor, reason)
        try:
            released = _release(client, keys, token, note, raw.get("ttl_ms"))
        except REDIS_ERRORS as exc:
            error = unavailable(
                exc, "release the lock", resource=resource, key=keys.lock, owner=current
            )
            outcome = (
                "unknown: Redis did not answer the release, so the lock may or may not have "
                f"been released ({exc})"
            )
            _audit(resource, current, raw, reason, False, outcome, user, actor, action)
            raise error from exc
        outcome = "released" if released else "refused: the lock changed owner or expired"
        if released:
            metrics.count("forced_releases", keys.family, raw.get("job_func", ""))
            metrics.flush_now()
    audit = _audit(
        resource, current or (wanted or ""), raw, reason, released, outcome, user, actor, action
    )
    if released and note is not None:
        _add_audit_id(client, prefix, resource, note, audit.pk)
    return ReleaseResult(released, outcome, audit)


def _release(
    client: Any, keys: LockKeys, token: str, note: tombstones.OperatorRelease, ttl: Any
) -> bool:
    """Compare-and-delete with the owner's own release (which hands the lock to the first
    live waiter in line, see :func:`waiting.release`), the note written just before it.

    The note goes first so that a holder noticing the loss always finds it; when nothing was
    released the note is taken back.
    """
    note_key = tombstones.key(keys.prefix, keys.resource)
    encoded = note.encode()
    client.set(note_key, encoded, px=tombstones.ttl_ms(int(ttl) if ttl else None))
    outcome, retried = waiting.release(client, keys, token, "", [])
    # Sent twice (its connection failed): GONE may be our own first run's release.
    if outcome is not lua.Outcome.OK and not (retried and outcome is lua.Outcome.GONE):
        if client.get(note_key) == encoded.encode():
            client.delete(note_key)  # nothing was released: no note about it
        return False
    try:
        client.zrem(keys.index, index_member(keys.resource, owner_hash(token)))
    except REDIS_ERRORS:
        pass  # a hint only: readers prune index entries whose lock is gone
    return True


def _add_audit_id(
    client: Any, prefix: str, resource: str, note: tombstones.OperatorRelease, audit_id: int
) -> None:
    noted = tombstones.OperatorRelease(note.owner, note.action, note.actor, note.reason, audit_id)
    try:
        client.set(tombstones.key(prefix, resource), noted.encode(), xx=True, keepttl=True)
    except REDIS_ERRORS:
        pass  # the note still says who released it, only without the audit id


def _audit(
    resource: str,
    owner: str,
    raw: dict[str, str],
    reason: str,
    released: bool,
    outcome: str,
    user: Any,
    actor: str,
    action: str,
) -> Any:
    from .models import LockAudit

    return LockAudit.objects.create(
        action=action,
        resource=resource,
        owner=owner,
        fence=int(raw["fence"]) if raw.get("fence") else None,
        holder={name: raw[name] for name in HOLDER_FIELDS if name in raw},
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
    held = active_locks(limit=10_000)
    health = lock_health(held)
    done = []
    for lock in held:
        state = health.get(lock.resource)
        if state is None or state.state is not DEAD:
            continue
        if dry_run:
            done.append((lock.resource, f"would release (holder dead: {state.why})"))
            continue
        result = force_release(
            lock.resource,
            owner=lock.owner,
            actor=actor,
            action="reap",
            reason=f"holder dead: {state.why}",
            renewed_ms=lock.renewed_ms,
        )
        done.append((lock.resource, result.outcome))
    return done

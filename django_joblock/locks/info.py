"""Who holds a lock: the holder details an acquire writes, and :func:`lock_info`.

The lock hash (``P:{resource}:lock``) is written by the scripts of :mod:`.scripts` with the
details gathered here (host, pid, RQ job) and decoded only here (:class:`LockHash`), into the
:class:`LockInfo` anyone can ask for ("is this resource locked, by whom, until when") without
taking the lock, and into the rows of the active-lock pages."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rq import get_current_job

from .. import conf
from ..backend import REDIS_ERRORS, Call, cache_argument, client, send, text, unavailable
from .keys import LockKeys, owner_hash, validate_limit, validate_resource
from .scripts import READ

HOST = socket.gethostname()[:255]


def job_context() -> tuple[str, str, str]:
    """(job id, function name, worker name) of the RQ job running in this thread, if any."""
    try:
        job = get_current_job()
    except Exception:  # noqa: BLE001 - outside a worker, rq may raise on a missing connection
        return "", "", ""
    if job is None:
        return "", "", ""
    return job.id or "", job.func_name or "", getattr(job, "worker_name", None) or ""


def holder_details() -> tuple[str, str, list[str | int]]:
    """(job id, job function, ACQUIRE's holder arguments) for a lock taken now, right here."""
    job_id, job_func, worker = job_context()
    return job_id, job_func, [HOST, os.getpid(), job_id, job_func, worker]


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as its hash records it (no token); times in Unix ms, server clock."""

    fence: int | None
    host: str
    pid: int | None
    job_id: str
    job_func: str
    worker: str
    acquired_ms: int | None
    renewed_ms: int | None
    renewals: int
    ttl_ms: int | None
    limit: int  # holders the lock allows at once (lock(limit=N)); 1 for a plain lock

    def holder(self) -> dict[str, Any]:
        """These fields as keyword arguments (to build a row that extends them)."""
        return {name: getattr(self, name) for name in Holder.__dataclass_fields__}

    def seconds_held(self, server_ms: int) -> float:
        """Seconds since the acquisition, at ``server_ms`` on the same server's clock."""
        return max(0.0, (server_ms - self.acquired_ms) / 1000) if self.acquired_ms else 0.0


@dataclass(frozen=True)
class LockHash(Holder):
    """The lock hash as stored: the one decoder of its fields. ``token`` is the owner's secret:
    only an operator release uses it; everything shown or logged uses :attr:`owner`."""

    token: str

    @classmethod
    def decode(cls, raw: dict[Any, Any]) -> LockHash | None:
        """The hash from an ``HGETALL`` reply (bytes or str), or None when it holds no lock."""
        fields = {text(k): text(v) for k, v in raw.items()}
        if not fields.get("token"):
            return None
        return cls(
            token=fields["token"],
            fence=_int(fields.get("fence")),
            host=fields.get("host", ""),
            pid=_int(fields.get("pid")),
            job_id=fields.get("job_id", ""),
            job_func=fields.get("job_func", ""),
            worker=fields.get("worker", ""),
            acquired_ms=_int(fields.get("acquired_ms")),
            renewed_ms=_int(fields.get("renewed_ms")),
            renewals=_int(fields.get("renewals")) or 0,
            ttl_ms=_int(fields.get("ttl_ms")),
            limit=_int(fields.get("limit")) or 1,
        )

    @property
    def owner(self) -> str:
        """The short hash of the token (what logs, pages and ``Lock.owner`` show)."""
        return owner_hash(self.token)

    def details(self) -> dict[str, str]:
        """The holder details an audit row keeps (no token, no fence; the limit of a lock with
        several holders), as text."""
        return {
            name: str(value)
            for name, value in self.holder().items()
            if name != "fence" and value not in (None, "") and (name, value) != ("limit", 1)
        }


@dataclass(frozen=True)
class LockInfo:
    """A snapshot of one held lock (:func:`lock_info`). ``acquired_at`` / ``renewed_at`` come from
    the Redis server clock (UTC), ``expires_in`` from the key's remaining TTL (seconds, when
    read). ``owner`` is the short hash of the holder's token (compare with ``Lock.owner``); the
    job fields are empty outside RQ."""

    resource: str
    owner: str
    fence: int
    ttl: float
    expires_in: float
    host: str
    pid: int | None
    job_id: str
    job_func: str
    worker: str
    acquired_at: datetime | None
    renewed_at: datetime | None
    renewals: int
    held_for: float = 0.0  # seconds since the acquisition, on the server's clock
    slot: int = 0  # which of the ``limit`` slots of a lock with several holders
    limit: int = 1  # holders the lock allows at once
    slots_used: int = 1  # slots held at the read (``lock_info(..., limit=N)``)


Snapshot = tuple[LockHash | None, int, int]  # (the hash or None, its PTTL in ms, server ms)


def read_many(found: Any, lock_keys: list[str]) -> list[Snapshot]:
    """A :data:`Snapshot` per lock hash in ``lock_keys`` in one round trip (READ: an atomic read
    on the lock's own server, with its clock). Raises redis-py's errors (map them with
    ``backend.unavailable``)."""
    calls: list[Call] = [(READ, [key], []) for key in lock_keys]
    snapshots = []
    for reply in send(found, calls) if calls else []:
        if isinstance(reply, Exception):
            raise reply
        seconds, micros, pttl, flat = reply
        raw = dict(zip(flat[::2], flat[1::2], strict=True))
        server_ms = int(seconds) * 1000 + int(micros) // 1000
        snapshots.append((LockHash.decode(raw) if int(pttl) != -2 else None, int(pttl), server_ms))
    return snapshots


def lock_info(
    resource: str, *, cache: str | None = None, using: str | None = None, limit: int = 1
) -> LockInfo | None:
    """Who holds ``resource`` now, or None when it is free: a snapshot (the lock may change
    hands a moment later) in one read-only round trip, which never takes or extends the lock.
    ``cache``: the django-redis cache alias of the locks (default ``JOBLOCK["REDIS_ALIAS"]``;
    ``using=``, its old name, warns). For a lock with several holders give its ``limit``:
    the holder of the lowest slot held is returned, with ``slots_used`` (see
    :func:`lock_holders` for each of them).

    Raises :class:`~django_joblock.InvalidResource` for a bad resource, ``ValueError`` for a
    bad limit and :class:`~django_joblock.LockBackendUnavailable` when Redis cannot be asked."""
    holders = lock_holders(resource, cache=cache_argument(cache, using), limit=limit)
    return holders[0] if holders else None


def lock_holders(resource: str, *, limit: int, cache: str | None = None) -> list[LockInfo]:
    """The holders of each slot of ``resource``, a lock with up to ``limit`` holders
    (``lock(resource, limit=N)``), lowest slot first: one read-only round trip, as
    :func:`lock_info`. Raises as :func:`lock_info` does."""
    settings = conf.get()
    resource = validate_resource(resource)
    keys = LockKeys(settings.KEY_PREFIX, resource)
    slot_keys = [keys.slot_key(slot) for slot in range(validate_limit("lock_info:", limit))]
    try:
        snapshots = read_many(client(cache), slot_keys)
    except REDIS_ERRORS as exc:
        raise unavailable(exc, "read the lock", resource=resource, key=keys.lock, owner="") from exc
    held = [
        (slot, found, pttl, server_ms)
        for slot, (found, pttl, server_ms) in enumerate(snapshots)
        if found is not None
    ]
    return [_info(resource, limit, len(held), *each) for each in held]


def _info(
    resource: str, limit: int, used: int, slot: int, found: LockHash, pttl: int, server_ms: int
) -> LockInfo:
    """The :class:`LockInfo` of one held ``slot`` of ``used`` (of ``limit``), from its read."""
    same = ("host", "pid", "job_id", "job_func", "worker", "renewals")  # as the hash has them
    return LockInfo(
        resource=resource,
        owner=found.owner,
        fence=found.fence or 0,
        ttl=(found.ttl_ms or 0) / 1000,
        expires_in=max(0, pttl) / 1000,
        acquired_at=_server_time(found.acquired_ms),
        renewed_at=_server_time(found.renewed_ms),
        held_for=found.seconds_held(server_ms),
        slot=slot,
        limit=found.limit,
        slots_used=used,
        **{name: getattr(found, name) for name in same},
    )


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _server_time(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=UTC)

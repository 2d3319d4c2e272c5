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
from .keys import LockKeys, owner_hash, validate_resource
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
        )

    @property
    def owner(self) -> str:
        """The short hash of the token (what logs, pages and ``Lock.owner`` show)."""
        return owner_hash(self.token)

    def details(self) -> dict[str, str]:
        """The holder details an audit row keeps (no token, no fence), as text."""
        return {
            name: str(value)
            for name, value in self.holder().items()
            if name != "fence" and value not in (None, "")
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


Snapshot = tuple[LockHash | None, int, int]  # (the hash or None, its PTTL in ms, server ms)


def read_many(found: Any, resources: list[str]) -> list[Snapshot]:
    """A :data:`Snapshot` per resource in one round trip (READ: an atomic read on the lock's own
    server, with its clock). Raises redis-py's errors (map them with ``backend.unavailable``)."""
    prefix = conf.get().KEY_PREFIX
    calls: list[Call] = [(READ, [LockKeys(prefix, r).lock], []) for r in resources]
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
    resource: str, *, cache: str | None = None, using: str | None = None
) -> LockInfo | None:
    """Who holds ``resource`` now, or None when it is free: a snapshot (the lock may change
    hands a moment later) in one read-only round trip, which never takes or extends the lock.
    ``cache``: the django-redis cache alias of the locks (default ``JOBLOCK["REDIS_ALIAS"]``;
    ``using=``, its old name, warns).

    Raises :class:`~django_joblock.InvalidResource` for a bad resource and
    :class:`~django_joblock.LockBackendUnavailable` when Redis cannot be asked."""
    settings = conf.get()
    resource = validate_resource(resource)
    try:
        ((found, pttl, server_ms),) = read_many(client(cache_argument(cache, using)), [resource])
    except REDIS_ERRORS as exc:
        key = LockKeys(settings.KEY_PREFIX, resource).lock
        raise unavailable(exc, "read the lock", resource=resource, key=key, owner="") from exc
    if found is None:
        return None
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
        **{name: getattr(found, name) for name in same},
    )


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _server_time(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=UTC)

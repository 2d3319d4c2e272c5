"""Who holds a lock: the holder details the acquire script writes, and :func:`lock_info`.

The lock hash (``P:{resource}:lock``, see :mod:`django_joblock.keys`) is written by the Lua
scripts of :mod:`django_joblock.lua` with the details gathered here (host, pid, RQ job), and
read back here into a :class:`LockInfo`, so that anyone can ask "is this resource locked, by
whom, until when" without taking the lock. The owner token itself never leaves this module:
readers get its short hash (``owner``), which is what logs, the admin and
:attr:`Lock.owner <django_joblock.Lock.owner>` show.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rq import get_current_job as _get_current_job

from . import conf
from .backend import REDIS_ERRORS, connection, unavailable
from .keys import LockKeys, owner_hash, validate_resource

HOST = socket.gethostname()[:255].encode()  # encoded once: redis-py passes bytes through
_PID: tuple[int, bytes] = (0, b"")


def pid_bytes() -> bytes:
    """This process's pid as bytes (recomputed after a fork)."""
    global _PID
    pid = os.getpid()
    if _PID[0] != pid:
        _PID = (pid, str(pid).encode())
    return _PID[1]


def job_context() -> tuple[str, str, str]:
    """(job id, function name, worker name) of the RQ job running in this thread, if any."""
    try:
        job = _get_current_job()
    except Exception:  # noqa: BLE001 - outside a worker, rq may raise on a missing connection
        return "", "", ""
    if job is None:
        return "", "", ""
    return job.id or "", job.func_name or "", getattr(job, "worker_name", None) or ""


def holder_details() -> tuple[str, str, list[bytes | str]]:
    """(job id, job function, the ACQUIRE script's holder arguments: host, pid, job id, job
    function, worker name) for a lock taken now, in this process and thread."""
    job_id, job_func, worker = job_context()
    return job_id, job_func, [HOST, pid_bytes(), job_id, job_func, worker]


@dataclass(frozen=True)
class LockInfo:
    """A snapshot of one held lock, read from Redis without taking or extending it.

    Times come from the Redis server clock (``acquired_at``, ``renewed_at``, UTC) and from
    the key's remaining TTL (``expires_in``, seconds, as Redis counts it when read). ``owner``
    is the short hash of the holder's token (compare with ``Lock.owner``); ``pid`` and
    ``host`` name the process that acquired it; the job fields are empty outside RQ.
    """

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


def lock_info(resource: str, *, using: str | None = None) -> LockInfo | None:
    """Who holds ``resource`` now, or None when it is free. One round trip (``MULTI`` of
    ``HGETALL`` + ``PTTL``), read-only: never takes, renews or extends the lock.

    A snapshot: the lock may be released or taken a moment later. Raises
    :class:`~django_joblock.exceptions.InvalidResource` for a bad resource and
    :class:`~django_joblock.exceptions.LockBackendUnavailable` when Redis cannot be asked.
    """
    settings = conf.get()
    keys = LockKeys(settings.KEY_PREFIX, validate_resource(resource))
    pipe = connection(using or settings.REDIS_ALIAS).pipeline(transaction=True)
    pipe.hgetall(keys.lock)
    pipe.pttl(keys.lock)
    try:
        raw, pttl = pipe.execute()
    except REDIS_ERRORS as exc:
        raise unavailable(exc, "read the lock", resource=resource, key=keys.lock, owner="") from exc
    fields = {_text(k): _text(v) for k, v in raw.items()}
    token = fields.get("token", "")
    if not token or pttl == -2:
        return None
    return LockInfo(
        resource=resource,
        owner=owner_hash(token),
        fence=_int(fields.get("fence")) or 0,
        ttl=(_int(fields.get("ttl_ms")) or 0) / 1000,
        expires_in=max(0, int(pttl)) / 1000,
        host=fields.get("host", ""),
        pid=_int(fields.get("pid")),
        job_id=fields.get("job_id", ""),
        job_func=fields.get("job_func", ""),
        worker=fields.get("worker", ""),
        acquired_at=_server_time(fields.get("acquired_ms")),
        renewed_at=_server_time(fields.get("renewed_ms")),
        renewals=_int(fields.get("renewals")) or 0,
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _server_time(ms: str | None) -> datetime | None:
    value = _int(ms)
    return None if value is None else datetime.fromtimestamp(value / 1000, tz=UTC)

"""Who holds a lock: the holder details the acquire script writes, and :func:`lock_info`.

The lock hash (``P:{resource}:lock``, see :mod:`django_joblock.keys`) is written by the Lua
scripts of :mod:`django_joblock.scripts` with the details gathered here (host, pid, RQ job),
and decoded only here (:class:`LockHash`), into the :class:`LockInfo` anyone can ask for ("is
this resource locked, by whom, until when") without taking the lock, and into the rows of the
active-lock pages (:mod:`django_joblock.monitoring`). Readers get the token's short hash
(``owner``), which is what logs, the admin and :attr:`Lock.owner <django_joblock.Lock.owner>`
show; the token itself only goes to the operator release's compare-and-delete.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rq import get_current_job as _get_current_job

from . import conf, lua
from .backend import REDIS_ERRORS, connection, is_cluster, text, unavailable
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
class Holder:
    """Who holds a lock, as its hash records it (no token). Times are Unix ms on the Redis
    server's clock."""

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
    """The lock hash ``P:{resource}:lock`` as stored: the one decoder of its fields.

    ``token`` is the owner's secret: only the operator release
    (:mod:`django_joblock.control`) uses it, for its compare-and-delete; everything shown or
    logged uses :attr:`owner`.
    """

    token: str

    # The hash holds these fields and the token, as the scripts of :mod:`django_joblock.scripts`
    # write them (ACQUIRE and the hand-over in RELEASE all of them, RENEW the renewal ones).

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
        """The holder details the audit log keeps (no token, no fence: it has its own column),
        as text."""
        return {
            name: str(value)
            for name, value in self.holder().items()
            if name != "fence" and value not in (None, "")
        }


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
    held_for: float = 0.0  # seconds since the acquisition, on the server's clock


def read_many(
    client: Any, resources: list[str], *, atomic: bool = False
) -> list[tuple[LockHash | None, int, int]]:
    """``(lock hash or None, its PTTL in ms, its server's clock in Unix ms)`` per resource, in
    one round trip (``TIME``, then ``HGETALL`` + ``PTTL`` per lock; a ``MULTI`` with
    ``atomic``, for one lock or locks of one hash tag).

    On Redis Cluster each lock is read by the ``READ`` script on the node of its slot (the
    client's pipeline sends them to their nodes together): an atomic snapshot of each lock, with
    the clock of the server that holds it.

    Raises redis-py's errors (callers map them with :func:`backend.unavailable`).
    """
    prefix = conf.get().KEY_PREFIX
    keys = [LockKeys(prefix, resource).lock for resource in resources]
    if is_cluster(client):
        return [_decode_read(reply) for reply in lua.read_each(client, keys)]
    pipe = client.pipeline(transaction=atomic)
    pipe.time()
    for key in keys:
        pipe.hgetall(key)
        pipe.pttl(key)
    clock, *replies = pipe.execute()
    server_ms = int(clock[0]) * 1000 + int(clock[1]) // 1000
    found = []
    for index in range(len(resources)):
        raw, pttl = replies[2 * index], int(replies[2 * index + 1])
        found.append((LockHash.decode(raw) if pttl != -2 else None, pttl, server_ms))
    return found


def _decode_read(reply: list[Any]) -> tuple[LockHash | None, int, int]:
    seconds, micros, pttl, flat = reply
    server_ms = int(seconds) * 1000 + int(micros) // 1000
    raw = dict(zip(flat[::2], flat[1::2], strict=True))
    return (LockHash.decode(raw) if int(pttl) != -2 else None, int(pttl), server_ms)


def read(client: Any, resource: str) -> tuple[LockHash | None, int, int]:
    """``(the lock hash or None, its PTTL in ms, the server's clock in Unix ms)`` of
    ``resource``, in one round trip (a ``MULTI``: see :func:`read_many`)."""
    return read_many(client, [resource], atomic=True)[0]


def info(resource: str, found: LockHash, pttl: int, server_ms: int) -> LockInfo:
    """The :class:`LockInfo` of a lock hash read by :func:`read`."""
    return LockInfo(
        resource=resource,
        owner=found.owner,
        fence=found.fence or 0,
        ttl=(found.ttl_ms or 0) / 1000,
        expires_in=max(0, pttl) / 1000,
        host=found.host,
        pid=found.pid,
        job_id=found.job_id,
        job_func=found.job_func,
        worker=found.worker,
        acquired_at=_server_time(found.acquired_ms),
        renewed_at=_server_time(found.renewed_ms),
        renewals=found.renewals,
        held_for=found.seconds_held(server_ms),
    )


def lock_info(resource: str, *, using: str | None = None) -> LockInfo | None:
    """Who holds ``resource`` now, or None when it is free. One round trip (see
    :func:`read`), read-only: never takes, renews or extends the lock.

    A snapshot: the lock may be released or taken a moment later. Raises
    :class:`~django_joblock.exceptions.InvalidResource` for a bad resource and
    :class:`~django_joblock.exceptions.LockBackendUnavailable` when Redis cannot be asked.
    """
    settings = conf.get()
    resource = validate_resource(resource)
    try:
        found, pttl, server_ms = read(connection(using or settings.REDIS_ALIAS), resource)
    except REDIS_ERRORS as exc:
        key = LockKeys(settings.KEY_PREFIX, resource).lock
        raise unavailable(exc, "read the lock", resource=resource, key=key, owner="") from exc
    return None if found is None else info(resource, found, pttl, server_ms)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _server_time(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=UTC)

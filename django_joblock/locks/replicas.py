"""``JOBLOCK["REPLICA_ACKS"]``: a new lock, and a heartbeat's renewal, counts only once enough
replicas have it.

Redis replicates asynchronously, so a failover can promote a replica that never received a
lock: the next holder gets it while the old one still works (the fence then refuses the old
holder's late writes). Waiting for ``REPLICA_ACKS`` replicas with ``WAIT`` after each acquire
narrows that window (docs/topologies.md); it costs one round trip per acquire. The renewal
thread ends its round trips with a ``WAIT`` too: after a failover the old primary takes writes
until the sentinels demote it (about 10 s after a ``SENTINEL FAILOVER``), and the holder's
connections stay on it; its renewals there must not count, or the holder would keep a lock
that the promoted primary lets expire and gives to another.
"""

from __future__ import annotations

import math
from typing import Any

from .. import conf
from ..backend import REDIS_ERRORS, is_cluster
from ..exceptions import JoblockConfigError, LockBackendUnavailable
from ..redis_steps import Send, Steps
from .scripts import RENEW, Outcome


def renew(key: str, token: str, ttl_ms: int) -> Steps[Outcome]:
    """RENEW the lock at ``key`` (held with ``token``) and, with ``REPLICA_ACKS``, ``WAIT`` in the
    same round trip (a write of *this* connection, which is what ``WAIT`` counts). Raises
    redis-py's errors, and :class:`LockBackendUnavailable` when renewed but short of the replicas
    within ``REPLICA_ACK_TIMEOUT``."""
    wait = replica_wait(math.inf)
    call = (RENEW, [key], [token, ttl_ms])
    reply, *acked = yield Send([call, wait] if wait else [call])
    if isinstance(reply, Exception):
        raise reply
    if wait and reply == Outcome.OK:
        check_acked(wait, acked[0])
    return Outcome(reply)


def shortfall(found: Any, key: str, token: str, ttl_ms: int) -> Steps[str]:
    """Why the lock at ``key`` (held with ``token``) did not reach ``REPLICA_ACKS`` replicas
    within ``REPLICA_ACK_TIMEOUT``, or "" when it did (one :func:`renew` on ``found``)."""
    if is_cluster(found):
        raise JoblockConfigError(
            "JOBLOCK['REPLICA_ACKS'] cannot be used with a Redis Cluster client "
            "(system check django_joblock.E008)"
        )
    try:
        if (yield from renew(key, token, ttl_ms)) is not Outcome.OK:
            return "the lock was lost before it was replicated"
    except LockBackendUnavailable as exc:
        return f"{exc} within {conf.get().REPLICA_ACK_TIMEOUT:g}s"
    except REDIS_ERRORS as exc:
        return f"its RENEW and WAIT for JOBLOCK['REPLICA_ACKS'] failed: {type(exc).__name__}: {exc}"
    return ""


def replica_wait(timeout: float) -> Any:
    """The ``WAIT`` for ``REPLICA_ACKS`` replicas (None without), for at most ``timeout`` s and
    ``REPLICA_ACK_TIMEOUT``: it ends an acquire's round trip and each of the renewal thread's."""
    settings = conf.get()
    wait_ms = max(1, int(min(settings.REPLICA_ACK_TIMEOUT, timeout) * 1000))
    return ["WAIT", settings.REPLICA_ACKS, wait_ms] if settings.REPLICA_ACKS else None


def check_acked(wait: list[Any], reply: Any) -> None:
    """:class:`LockBackendUnavailable` unless ``reply`` to ``wait`` (:func:`replica_wait`)
    counts the replicas it asked for (renewals short of them count as failed)."""
    if isinstance(reply, Exception) or int(reply) < wait[1]:
        why = f"{reply} of the {wait[1]} replicas JOBLOCK['REPLICA_ACKS'] asks for acknowledged"
        raise LockBackendUnavailable(why)

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

from typing import Any

from .. import conf
from ..backend import REDIS_ERRORS, is_cluster, send
from ..exceptions import JoblockConfigError, LockBackendUnavailable
from .scripts import RENEW, Outcome


def shortfall(found: Any, key: str, token: str, ttl_ms: int) -> str:
    """Why the lock at ``key`` (held with ``token``) did not reach ``REPLICA_ACKS`` replicas
    within ``REPLICA_ACK_TIMEOUT``, or "" when it did. One round trip: a RENEW (a write of
    *this* connection, which is what ``WAIT`` counts), then ``WAIT acks timeout``."""
    settings = conf.get()
    acks, timeout = settings.REPLICA_ACKS, settings.REPLICA_ACK_TIMEOUT
    if is_cluster(found):
        raise JoblockConfigError(
            "JOBLOCK['REPLICA_ACKS'] cannot be used with a Redis Cluster client "
            "(system check django_joblock.E008)"
        )
    calls = [(RENEW, [key], [token, ttl_ms]), ["WAIT", acks, int(timeout * 1000)]]
    try:
        renewed, acked = send(found, calls)
        for reply in (renewed, acked):
            if isinstance(reply, Exception):
                raise reply
    except REDIS_ERRORS as exc:
        acked, error = 0, f"{type(exc).__name__}: {exc}"
    else:
        error = "" if renewed == Outcome.OK else "lost before it was replicated"
        acked = -1 if error else int(acked)
    if acked >= acks:
        return ""
    return (
        f"the lock reached {max(acked, 0)} of the {acks} replicas JOBLOCK['REPLICA_ACKS'] asks "
        f"for within {timeout:g}s ({error or 'WAIT timed out'})"
    )


def renewal_wait(timeout: float) -> list[Any] | None:
    """The ``WAIT`` that ends a round trip of heartbeat renewals, waiting at most ``timeout`` s
    (and ``REPLICA_ACK_TIMEOUT``); None without ``REPLICA_ACKS``."""
    settings = conf.get()
    wait_ms = max(1, int(min(settings.REPLICA_ACK_TIMEOUT, timeout) * 1000))
    return ["WAIT", settings.REPLICA_ACKS, wait_ms] if settings.REPLICA_ACKS else None


def check_acked(wait: list[Any], reply: Any) -> None:
    """:class:`LockBackendUnavailable` (the renewals then count as failed) unless ``reply`` to
    ``wait`` (:func:`renewal_wait`) counts the replicas it asked for."""
    if isinstance(reply, Exception) or int(reply) < wait[1]:
        why = f"the renewals reached {reply} of the {wait[1]} replicas JOBLOCK['REPLICA_ACKS'] "
        raise LockBackendUnavailable(why + "asks for")

"""The Redis connection behind the locks, and the mapping of Redis failures to one exception.

The connection is django-redis' ``get_redis_connection(alias, write=True)`` (never
``cache.lock()``). The renewal thread gets its *own* client on the same server with short socket
timeouts and no client-side retries, because redis-py's defaults can block for about a minute on
a black-holed server, far past the lock's TTL.
"""

from __future__ import annotations

import inspect
import os
import threading
from typing import Any

import redis
from redis import exceptions as redis_exceptions
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .exceptions import JoblockConfigError, LockBackendUnavailable

# Server replies that mean "cannot serve you now", as opposed to a bug in a command.
_UNAVAILABLE_PREFIXES = (
    "OOM",
    "LOADING",
    "BUSY",
    "READONLY",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "TRYAGAIN",
    "NOREPLICAS",
)


# redis-py maps some of those replies to classes (and strips the prefix from the message).
_UNAVAILABLE_CLASSES = tuple(
    getattr(redis_exceptions, name)
    for name in ("OutOfMemoryError", "BusyLoadingError", "ReadOnlyError")
    if hasattr(redis_exceptions, name)
)


_clients: dict[str, Any] = {}


def connection(alias: str) -> Any:
    """The django-redis client of cache ``alias`` (write side); raises on a bad alias.

    Cached per alias (redis-py clients are thread-safe and fork-safe: the pool reconnects in a
    child); the cache is dropped when ``CACHES`` or ``JOBLOCK`` change.
    """
    client = _clients.get(alias)
    if client is None:
        client = _clients[alias] = _lookup(alias)
    return client


def forget_connections() -> None:
    """Drop cached clients (after a settings change)."""
    _clients.clear()


def _lookup(alias: str) -> Any:
    from django.conf import settings

    caches = getattr(settings, "CACHES", {})
    if alias not in caches:
        raise JoblockConfigError(
            f"JOBLOCK['REDIS_ALIAS'] / using={alias!r} is not in settings.CACHES "
            f"(known: {', '.join(sorted(caches)) or 'none'})."
        )
    from django_redis import get_redis_connection

    try:
        return get_redis_connection(alias, write=True)
    except NotImplementedError as exc:
        raise JoblockConfigError(
            f"Cache {alias!r} is not a django-redis cache (BACKEND must be "
            f"'django_redis.cache.RedisCache'); django-joblock needs its Redis connection."
        ) from exc


def _takes_no_command_name() -> bool:
    # redis-py >= 5.3 deprecates get_connection(command_name); older versions require it.
    param = inspect.signature(redis.ConnectionPool.get_connection).parameters.get("command_name")
    return param is None or param.default is not inspect.Parameter.empty


_NO_COMMAND_NAME = _takes_no_command_name()


def pack(args: tuple[Any, ...]) -> bytes:
    """RESP-encode one command of str / bytes / int arguments (UTF-8 for str)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


def execute(client: Any, *args: Any) -> Any:
    """Send one command on a pooled connection of ``client`` and return the raw reply.

    The lock hot path (acquire and release scripts) uses this instead of
    ``client.execute_command``: it skips redis-py's per-command retry and instrumentation
    layers (about a third of a loopback round trip) and, on purpose, never retries. A retried
    acquire whose first reply was lost would find our own lock and report it busy; the caller
    maps the failure to :class:`LockBackendUnavailable` instead. A connection that failed
    mid-command is dropped, never returned to the pool half-read. Clients without a plain
    connection pool (e.g. Redis Cluster) take the regular path.
    """
    reply = execute_many(client, [args])[0]
    if isinstance(reply, ResponseError):
        raise reply
    return reply


def execute_many(client: Any, commands: list[Any]) -> list[Any]:
    """Send several commands in one round trip (a pipeline without MULTI) on the lean path.

    Returns one reply per command; a command the server refused gives its ``ResponseError``
    as its reply (the others still ran), any other failure raises.
    """
    pool = getattr(client, "connection_pool", None)
    if pool is None or not hasattr(pool, "release"):
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute(raise_on_error=False))
    packed = b"".join(pack(tuple(command)) for command in commands)
    conn = _dedicated(pool)
    try:
        if conn._sock is not None and conn.can_read():
            # Closed by the server (restart, CLIENT KILL) or unread bytes: reconnect before
            # sending, as the pool's own checkout does; the command was never sent.
            conn.disconnect()
        conn.send_packed_command([packed])
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:  # read whole: the connection is still in step
                replies.append(exc)
        return replies
    except BaseException:
        conn.disconnect()
        raise


class _Dedicated:
    """One pooled connection checked out for the life of a thread (returned when it ends).

    Checking a connection out of and back into redis-py's pool costs more than the rest of a
    command's client-side work (locks, pid checks, instrumentation). The connection stays
    *in use* in the pool's books, so nobody else is handed it; ``pool.disconnect()`` still
    closes it and the next command reconnects.
    """

    __slots__ = ("conn", "pid", "pool")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.pid = os.getpid()
        self.conn = pool.get_connection() if _NO_COMMAND_NAME else pool.get_connection("EVALSHA")

    def __del__(self) -> None:  # the thread ended (thread-locals are cleared) or pool changed
        if self.pid == os.getpid():
            try:
                self.pool.release(self.conn)
            except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to save
                pass


_local = threading.local()


def _dedicated(pool: Any) -> Any:
    """This thread's dedicated connection of ``pool`` (a new one after a fork)."""
    held: dict[int, _Dedicated] | None = getattr(_local, "held", None)
    if held is None:
        held = _local.held = {}
    found = held.get(id(pool))
    if found is None or found.pid != os.getpid() or found.pool is not pool:
        found = held[id(pool)] = _Dedicated(pool)
    return found.conn


def is_unavailable(exc: BaseException) -> bool:
    """True when ``exc`` means Redis could not serve the request (down, timeout, OOM...)."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError, *_UNAVAILABLE_CLASSES)):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(_UNAVAILABLE_PREFIXES)


REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, ResponseError, OSError)


def unavailable(
    exc: BaseException, action: str, *, resource: str, key: str, owner: str
) -> LockBackendUnavailable:
    """The :class:`LockBackendUnavailable` to raise for ``exc`` (one of ``REDIS_ERRORS``).

    Re-raises ``exc`` itself when it is not an availability problem (e.g. a WRONGTYPE reply:
    a bug or a foreign key in our namespace, which must not be reported as "Redis down").
    Use as ``except REDIS_ERRORS as exc: raise unavailable(exc, ...) from exc``.
    """
    if not is_unavailable(exc):
        raise exc
    return LockBackendUnavailable(
        f"Redis unavailable while trying to {action}: {type(exc).__name__}: {exc}",
        resource=resource,
        key=key,
        owner=owner,
    )


def renewal_client(base: Any, timeout: float) -> redis.Redis:
    """A client on ``base``'s server with ``timeout``-second sockets and no retries."""
    pool = base.connection_pool
    kwargs = dict(pool.connection_kwargs)
    kwargs.update(
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry_on_timeout=False,
        retry=Retry(NoBackoff(), 0),
        client_name="joblock-renewer",
        health_check_interval=0,
    )
    kwargs.pop("retry_on_error", None)
    new_pool = redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    return redis.Redis(connection_pool=new_pool)

"""The Redis connection behind the locks, and the mapping of Redis failures to one exception.

The connection is django-redis' ``get_redis_connection(alias, write=True)`` (never
``cache.lock()``). The lock scripts go through a lean command path on that client's server
(:func:`execute_packed`): a few connections of its own per process, never one held out of the
pool, so a capped pool is never starved; stale connections replaced before sending; one retry
of a call whose connection failed. The renewal thread gets its *own* client on the same server
with short socket timeouts and no client-side retries, because redis-py's defaults can block
for about a minute on a black-holed server, far past the lock's TTL. (A waiting acquire's
``BLPOP`` has connections of its own too: see :mod:`django_joblock.waiting`.)
"""

from __future__ import annotations

import inspect
import os
import select
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import redis
from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver
from django_redis import get_redis_connection
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
    """Drop cached clients and close the lean path's connections (after a settings change)."""
    _clients.clear()
    _forget_lean_connections()


@receiver(setting_changed)
def _on_setting_changed(setting: str, **kwargs: Any) -> None:
    # JOBLOCK names the alias (REDIS_ALIAS), CACHES where it points.
    if setting in ("JOBLOCK", "CACHES"):
        forget_connections()


def _lookup(alias: str) -> Any:
    caches = getattr(settings, "CACHES", {})
    if alias not in caches:
        raise JoblockConfigError(
            f"JOBLOCK['REDIS_ALIAS'] / using={alias!r} is not in settings.CACHES "
            f"(known: {', '.join(sorted(caches)) or 'none'})."
        )
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

# Connections the lean path keeps per process and pool, besides the pool's own (see _Lean).
LEAN_CONNECTIONS = 4
# Calls a process makes through the pool's connections before the lean path makes its own: a
# forked work horse (a handful of lock calls, then it exits) never pays for a connection of
# its own beside the one RQ already has in the pool.
LEAN_AFTER = 8


def pack(args: tuple[Any, ...] | list[Any]) -> bytes:
    """RESP-encode one command of str / bytes / int arguments (UTF-8 for str)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        # Exact-class checks first: this runs for every argument of every lock command.
        if arg.__class__ is str:
            arg = arg.encode()
        elif arg.__class__ is not bytes:
            if isinstance(arg, str):
                arg = arg.encode()
            elif isinstance(arg, int):
                arg = b"%d" % arg
        parts.append(b"$%d\r\n%b\r\n" % (len(arg), arg))
    return b"".join(parts)


class Replies(list[Any]):
    """Replies of :func:`execute_many`, one per command; ``retried`` is True when the commands
    were sent a second time after the connection failed (so their first run may have happened:
    only idempotent commands, or scripts that recognise their own token, are sent this way)."""

    retried: bool = False


def execute(client: Any, *args: Any) -> Any:
    """Send one command on the lean path of ``client`` and return the raw reply.

    The lock hot path (acquire and release scripts) uses this instead of
    ``client.execute_command``: it skips redis-py's per-command pool checkout, retry and
    instrumentation layers (together more than a loopback round trip's worth of client work).
    A refused command raises its ``ResponseError``. See :func:`execute_packed` for connections
    and retries.
    """
    reply = execute_many(client, [args])[0]
    if isinstance(reply, ResponseError):
        raise reply
    return reply


def execute_many(client: Any, commands: list[Any], *, retry: bool = True) -> Replies:
    """Send several commands in one round trip (a pipeline without MULTI) on the lean path.

    Returns one reply per command; a command the server refused gives its ``ResponseError``
    as its reply (the others still ran), any other failure raises. Clients without a plain
    connection pool (e.g. Redis Cluster) take redis-py's pipeline instead.
    """
    if not hasattr(getattr(client, "connection_pool", None), "connection_kwargs"):
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return Replies(pipe.execute(raise_on_error=False))
    return execute_packed(
        client, b"".join([pack(command) for command in commands]), len(commands), retry=retry
    )


def execute_packed(client: Any, packed: bytes, count: int, *, retry: bool = True) -> Replies:
    """Send ``count`` commands already RESP-encoded in ``packed``; read ``count`` replies.

    Connections: one of the process's few lean connections of ``client``'s pool (see
    :class:`_Lean`), else, when all are busy in other threads, one checked out of the pool for
    this call only. A connection is never kept checked out of the pool between calls, so a
    pool capped with ``max_connections`` is never starved by the locks.

    Failures: an idle connection the server closed (restart, failover, ``CLIENT KILL``,
    idle timeout) is reconnected *before* sending. A connection that fails mid-call is
    closed, never reused half-read; with ``retry`` the commands are then sent once more on
    a fresh connection (``Replies.retried``): callers only allow that for commands that are
    safe to run twice. Timeouts are never retried (the caller's time is bounded).
    """
    pool = client.connection_pool
    lean = _lean(pool)
    for attempt in (0, 1):
        conn, own = lean.take(pool)
        try:
            if own and conn._sock is not None:
                drop_if_stale(conn)
            conn.send_packed_command([packed], check_health=False)
            replies = Replies()
            for _ in range(count):
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:  # read whole: the connection is still in step
                    replies.append(exc)
        except RedisConnectionError:
            conn.disconnect()
            if attempt or not retry:
                raise
            continue
        except BaseException:
            conn.disconnect()
            raise
        finally:
            lean.give(pool, conn, own)
        replies.retried = bool(attempt)
        return replies
    raise AssertionError("unreachable")  # pragma: no cover


def drop_if_stale(conn: Any) -> None:
    """Close ``conn`` if the server closed it or it has unread bytes (it reconnects on send)."""
    try:
        stale = _readable(conn)
    except (RedisConnectionError, RedisTimeoutError, OSError):
        stale = True  # "Connection closed by server.": the command was never sent
    if stale:
        conn.disconnect()


_POLL_ATTRIBUTE = "_django_joblock_poll"


def _readable(conn: Any) -> bool:
    """True when an idle connection has something to read: bytes the server sent unasked, or
    its end of the connection (a restart, ``CLIENT KILL``, an idle timeout).

    One ``poll(0)`` on the socket, with the poll object kept on the connection for as long as
    its socket lasts: this runs before every lock command, and redis-py's ``can_read()`` costs
    several system calls. The lean path always reads whole replies, so nothing can wait in the
    parser's buffer; ``can_read()`` stays the fallback where ``poll`` does not exist.
    """
    sock = conn._sock
    if not hasattr(select, "poll"):  # pragma: no cover - not on Linux / macOS
        return bool(conn.can_read())
    cached: tuple[Any, Any] | None = getattr(conn, _POLL_ATTRIBUTE, None)
    if cached is None or cached[0] is not sock:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLPRI)
        cached = (sock, poller)
        setattr(conn, _POLL_ATTRIBUTE, cached)
    return bool(cached[1].poll(0))


class _Lean:
    """The lean path's connections to one pool's server, in this process.

    Checking a connection out of redis-py's pool and back costs about as much as the rest of a
    command's client-side work (locks, pid checks, metrics hooks, events), and keeping one
    checked out per thread would starve a pool capped with ``max_connections``. So the lean
    path keeps up to :data:`LEAN_CONNECTIONS` connections of its own, made with the pool's
    connection class and arguments but outside its books, shared between threads (a thread
    takes one for a single call, LIFO so a busy thread keeps a warm one). When all are busy
    it checks one out of the pool for that call, like any redis-py command. So do a process's
    first :data:`LEAN_AFTER` calls: making a connection (a connect, a handshake, redis-py's
    driver metadata) costs more than a short-lived process saves with it.

    It lives on the pool object itself (see :func:`per_pool`), so it goes when the pool goes
    (a renewal client replaced by one with a shorter timeout, say), and a new one replaces it
    after a fork: a child must never use its parent's sockets.
    """

    __slots__ = ("__weakref__", "calls", "guard", "idle", "made", "pid")

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.idle: list[Any] = []
        self.made = 0
        self.calls = 0
        self.guard = threading.Lock()

    def take(self, pool: Any) -> tuple[Any, bool]:
        """A connection and whether it is a lean one (False: checked out of the pool)."""
        try:
            return self.idle.pop(), True  # list.pop is atomic: no lock on the hot path
        except IndexError:
            pass
        with self.guard:
            self.calls += 1
            if self.made < LEAN_CONNECTIONS and self.calls > LEAN_AFTER:
                self.made += 1
                return pool.connection_class(**pool.connection_kwargs), True
        if _NO_COMMAND_NAME:
            return pool.get_connection(), False
        return pool.get_connection("EVALSHA"), False

    def give(self, pool: Any, conn: Any, own: bool) -> None:
        if own:
            self.idle.append(conn)
        else:
            pool.release(conn)

    def close(self) -> None:
        """Close the idle connections' sockets (they stay, and reconnect when next used)."""
        for conn in list(self.idle):
            try:
                conn.disconnect()
            except Exception:  # noqa: BLE001 - closing a dead socket; nothing to save
                pass


class Stash(Protocol):
    """Connections kept per process and pool (see :func:`per_pool`)."""

    pid: int

    def close(self) -> None:
        """Close the idle connections' sockets."""


_S = TypeVar("_S", bound=Stash)
_LEAN_ATTRIBUTE = "_django_joblock_lean"
# Every stash made by per_pool, to close their sockets on a settings change.
_stashes: weakref.WeakSet[Stash] = weakref.WeakSet()
_stashes_guard = threading.Lock()


def _lean(pool: Any) -> _Lean:
    """The :class:`_Lean` of ``pool`` in this process."""
    return per_pool(pool, _LEAN_ATTRIBUTE, _Lean)


def per_pool(pool: Any, attribute: str, make: Callable[[], _S]) -> _S:
    """The ``make()`` object stored on ``pool`` under ``attribute`` for this process.

    Stored on the pool, it goes when the pool goes; a new one replaces it after a fork (a
    child must never use its parent's sockets); :func:`forget_connections` closes it.
    """
    found: _S | None = getattr(pool, attribute, None)
    if found is None or found.pid != os.getpid():
        with _stashes_guard:
            found = getattr(pool, attribute, None)
            if found is None or found.pid != os.getpid():
                found = make()
                setattr(pool, attribute, found)
                _stashes.add(found)
    return found


def _forget_lean_connections() -> None:
    with _stashes_guard:
        stashes = list(_stashes)
    for stash in stashes:
        if stash.pid == os.getpid():
            stash.close()


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

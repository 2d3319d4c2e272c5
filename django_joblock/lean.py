"""The lean command path: the lock scripts' round trips, and the only module that uses
redis-py below its public API.

redis-py's ``execute_command`` adds, per command, a pool checkout, retry and instrumentation
layers (together more than a loopback round trip's worth of client work), and it retries on
its own, which a lock acquire must not do blindly. This path sends pre-encoded commands on a
connection of the client's pool's class, made with the pool's arguments, and reads the raw
replies:

- :func:`execute` / :func:`execute_many` / :func:`execute_packed`: one round trip for one or
  several commands (a pipeline without ``MULTI``), on one of the process's few lean
  connections (:class:`_Lean`), never one held out of the pool between calls, so a capped
  pool is never starved; an idle connection the server closed is replaced *before* sending;
  a call whose connection fails mid-way is retried once when its caller allows it.
- :func:`blocking_pop`: a ``BLPOP`` on a connection of its own (:class:`_Blocking`), so a
  blocked waiter never holds one of the pool's connections.

What it relies on from redis-py (checked against the oldest and newest supported redis-py by
``tests/test_lean_contract.py``): a pool's ``connection_class`` and ``connection_kwargs``; a
connection's ``connect()``, ``send_packed_command(bytes, check_health=False)``,
``read_response()``, ``disconnect()`` and ``_sock`` (None while disconnected); a pool's
``get_connection()`` and ``release()``. A client whose pool has no ``connection_kwargs`` (e.g.
Redis Cluster) takes redis-py's own pipeline and ``blpop`` instead: :func:`usable` says which.
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
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

_LIB_VERSION = redis.__version__
_TAKES_LIB_VERSION: dict[type, bool] = {}


def new_connection(pool: Any, **overrides: Any) -> Any:
    """A connection of ``pool``'s class with the pool's arguments (and ``overrides``), not
    connected yet and outside the pool's books.

    redis-py 8 looks its own version up in the installed package metadata for every new
    connection (milliseconds: a waiter's first block, a work horse's first lock call would
    pay it); the version is passed in instead, as the pool's connections report it.
    """
    kwargs = {**pool.connection_kwargs, **overrides}
    cls = pool.connection_class
    takes = _TAKES_LIB_VERSION.get(cls)
    if takes is None:
        try:
            takes = "lib_version" in inspect.signature(cls.__init__).parameters
        except (TypeError, ValueError):
            takes = False
        _TAKES_LIB_VERSION[cls] = takes
    if takes:
        kwargs.setdefault("lib_version", _LIB_VERSION)
    return cls(**kwargs)


def usable(client: Any) -> bool:
    """True when ``client``'s pool can serve the lean path (a plain ``ConnectionPool``)."""
    return hasattr(getattr(client, "connection_pool", None), "connection_kwargs")


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
    """RESP-encode one command of str / bytes / int / float arguments (UTF-8 for str, a
    float as ``repr``, as redis-py does). Anything else raises ``TypeError`` naming it."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        # Exact-class checks first: this runs for every argument of every lock command.
        if arg.__class__ is str:
            arg = arg.encode()
        elif arg.__class__ is not bytes:
            arg = _encode(arg)
        parts.append(b"$%d\r\n%b\r\n" % (len(arg), arg))
    return b"".join(parts)


def _encode(arg: Any) -> bytes:
    if isinstance(arg, (bytes, bytearray, memoryview)):
        return bytes(arg)
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, bool):
        raise TypeError(f"Cannot send a bool to Redis as a command argument: {arg!r}")
    if isinstance(arg, int):
        return b"%d" % arg
    if isinstance(arg, float):
        return repr(arg).encode()
    raise TypeError(
        f"Cannot send {type(arg).__name__} to Redis as a command argument: {arg!r} "
        "(str, bytes, int or float)"
    )


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
    if not usable(client):
        return _pipelined(client, commands)
    return _send_packed(
        client, b"".join([pack(command) for command in commands]), len(commands), retry
    )


def _pipelined(client: Any, commands: list[Any]) -> Replies:
    """The commands through ``client``'s own pipeline (no ``MULTI``): on Redis Cluster,
    redis-py's ``ClusterPipeline`` sends each to the node of its key's slot (commands of
    different slots and nodes may be mixed), follows ``MOVED`` / ``ASK`` and retries as the
    client is configured to; replies come back in the commands' order."""
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return Replies(pipe.execute(raise_on_error=False))


def unpack(packed: bytes) -> list[list[Any]]:
    """The commands :func:`pack` encoded into ``packed`` (one after another), as argument
    lists of bytes, the command's name as str (redis-py's Cluster routing looks names up as
    str): what a client without a plain pool sends through its own pipeline."""
    commands: list[list[Any]] = []
    at = 0
    while at < len(packed):
        if packed[at : at + 1] != b"*":
            raise ValueError(f"not a packed command at byte {at}")
        end = packed.index(b"\r\n", at)
        count, at = int(packed[at + 1 : end]), end + 2
        args: list[Any] = []
        for _ in range(count):
            end = packed.index(b"\r\n", at)
            size, at = int(packed[at + 1 : end]), end + 2
            args.append(packed[at : at + size])
            at += size + 2
        commands.append([args[0].decode(), *args[1:]] if args else args)
    return commands


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

    A client without a plain connection pool (Redis Cluster) gets the commands unpacked and
    sent through its own pipeline (see :func:`execute_many`), retried as that client is
    configured to (the renewal thread's cluster client: never).
    """
    if not usable(client):
        return _pipelined(client, unpack(packed))
    return _send_packed(client, packed, count, retry)


def _send_packed(client: Any, packed: bytes, count: int, retry: bool) -> Replies:
    pool = client.connection_pool
    lean = _lean(pool)
    for attempt in (0, 1):
        conn, own = lean.take(pool)
        try:
            if own:
                ready(conn)
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


def ready(conn: Any) -> None:
    """Make a connection of the lean path ready to send: closed first if stale (see
    :func:`drop_if_stale`), then connected through its own ``connect()``.

    ``connect()`` is where a Sentinel-managed connection asks the sentinels for the current
    primary; redis-py 8's ``send_packed_command`` connects a closed connection to the last
    address instead, which after a failover is the dead (or demoted) primary.
    """
    if conn._sock is not None:
        drop_if_stale(conn)
    if conn._sock is None:
        conn.connect()


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
                return new_connection(pool), True
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
        _disconnect(self.idle)


def _disconnect(connections: list[Any]) -> None:
    for conn in list(connections):
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


def forget() -> None:
    """Close the idle sockets of every stash of this process (after a settings change)."""
    with _stashes_guard:
        stashes = list(_stashes)
    for stash in stashes:
        if stash.pid == os.getpid():
            stash.close()


# -- blocking pops ---------------------------------------------------------------------------
# Longest single BLPOP (s); its connection's socket timeout is this plus the pool's own socket
# timeout, so a block never reads as a dead server. Waiting acquires block at most this long.
MAX_BLOCK = 1.0
# Idle blocking connections kept per process and pool for the next waiter (see _Blocking).
IDLE_BLOCKING_CONNECTIONS = 2
_BLOCKING_ATTRIBUTE = "_django_joblock_blocking"


class _Blocking:
    """Connections for blocking pops (``BLPOP``) to one pool's server, in this process.

    A blocked ``BLPOP`` holds its connection for the whole block, so a waiting acquire never
    uses one of the pool's connections (a few waiters would starve a capped pool and with it
    the Django cache) nor one of the lean path's (shared by every thread's acquire and
    release). Each blocking call takes a connection of its own, made like the pool's but with
    a socket timeout that covers the block; up to :data:`IDLE_BLOCKING_CONNECTIONS` are kept
    for the next waiter, the others closed. N threads waiting at once use N of them.
    """

    __slots__ = ("__weakref__", "idle", "pid")

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.idle: list[Any] = []

    def take(self, pool: Any) -> Any:
        try:
            return self.idle.pop()
        except IndexError:
            slack = pool.connection_kwargs.get("socket_timeout") or 5.0
            return new_connection(pool, socket_timeout=MAX_BLOCK + slack)

    def give(self, conn: Any) -> None:
        if len(self.idle) < IDLE_BLOCKING_CONNECTIONS:
            self.idle.append(conn)
        else:
            conn.disconnect()

    def close(self) -> None:
        _disconnect(self.idle)


def blocking_pop(client: Any, key: str, timeout: float) -> Any:
    """``BLPOP key`` for up to ``timeout`` seconds (at most :data:`MAX_BLOCK`; at least 1 ms,
    since 0 would block forever). The element popped, or None on timeout.

    Runs on a connection of its own (see :class:`_Blocking`), never on one of the pool's. An
    idle connection the server closed is replaced before sending; a failure raises redis-py's
    ``ConnectionError`` / ``TimeoutError`` and the connection is closed, never reused half-read
    (an interrupted block, e.g. by a signal handler that raises, likewise). Clients without a
    plain connection pool (e.g. Redis Cluster) use their own ``blpop``.
    """
    seconds = b"%.3f" % min(max(timeout, 0.001), MAX_BLOCK)
    pool = getattr(client, "connection_pool", None)
    if not usable(client):
        popped = client.blpop([key], timeout=float(seconds))
        return None if popped is None else popped[1]
    blocking = per_pool(pool, _BLOCKING_ATTRIBUTE, _Blocking)
    conn = blocking.take(pool)
    try:
        ready(conn)
        conn.send_packed_command([pack(("BLPOP", key, seconds))], check_health=False)
        reply = conn.read_response()
    except BaseException:
        conn.disconnect()
        raise
    finally:
        blocking.give(conn)
    return None if reply is None else reply[1]

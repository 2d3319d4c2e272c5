"""The asyncio Redis clients of the locks (``redis.asyncio``), and the driver of their flows.

An alias's asyncio clients are made with redis-py's public constructors from the connection
class and arguments of its base client (:func:`django_joblock.backend.connection`): the same
server, database, password and TLS, the same socket timeouts as :func:`~.backend.client`
(``JOBLOCK["REDIS_TIMEOUT"]``, no retries) and :data:`~.backend.POOL_SIZE` connections that
callers wait for; waiting acquires block on connections of their own. A ``redis.asyncio``
connection belongs to the event loop that opened it, so each running loop gets its own
clients. A closed loop's clients are dropped when another loop makes its own (their
connections then close as garbage), so a process that runs loop after loop (``asyncio.run()``
again and again, asgiref's ``async_to_sync``, which an ``async def`` job's body runs in) keeps
the connections of its open loops only. One Redis server only: on Sentinel or Cluster the asyncio
locks raise :class:`~.exceptions.JoblockConfigError` (use the sync locks in a thread).

:func:`drive` runs a lock's flow (:mod:`.redis_steps`) on these clients: the flows are the
sync locks' own, so both speak the same protocol and exclude each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis
import redis.asyncio
from redis.asyncio import connection as aio_connection
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, ResponseError

from . import conf
from .backend import (
    MAX_BLOCK,
    POOL_SIZE,
    Call,
    Script,
    connection,
    forgotten,
    is_cluster,
    own_options,
    pipeline,
)
from .exceptions import JoblockConfigError
from .redis_steps import RunScript, Send, Steps, T, advance

# Sync connection classes and their asyncio twins; the first that matches is used.
_CONNECTION_CLASSES = (
    (redis.connection.SSLConnection, aio_connection.SSLConnection),
    (redis.connection.UnixDomainSocketConnection, aio_connection.UnixDomainSocketConnection),
    (redis.connection.Connection, aio_connection.Connection),
)
# Arguments of a sync connection an asyncio one must not inherit (sync objects, or the
# retry policy, which the overrides set).
_NOT_INHERITED = frozenset(
    {"parser_class", "retry", "retry_on_error", "retry_on_timeout", "redis_connect_func"}
)


# Each event loop's clients by (alias, role), for the loops that made clients and are not known
# to be closed. (Not a weak dictionary: the clients' connections refer to their loop, so a weak
# key would never die.)
_clients: dict[asyncio.AbstractEventLoop, dict[tuple[str, str], Any]] = {}
_waiters: dict[int, int] = {}  # blocking client id -> waiting acquires using it now


def client(alias: str | None = None) -> Any:
    """The asyncio command client of ``alias`` (default ``REDIS_ALIAS``) for the running loop.

    Raises :class:`JoblockConfigError` when the alias's Redis is a Cluster or Sentinel, or
    its connection class is not one redis-py's asyncio client has."""
    settings = conf.get()
    return _client(alias or settings.REDIS_ALIAS, "commands", settings.REDIS_TIMEOUT)


@contextlib.asynccontextmanager
async def blocking_client(alias: str) -> AsyncIterator[Any]:
    """``alias``'s asyncio client for waiting acquires (one connection per concurrent waiter,
    sockets outlasting any ``BLPOP`` block), with this waiter counted while inside: the last
    to leave closes the idle connections."""
    blocking = _client(alias, "blocking", MAX_BLOCK + conf.get().REDIS_TIMEOUT)
    key = id(blocking)
    _waiters[key] = _waiters.get(key, 0) + 1
    try:
        yield blocking
    finally:
        _waiters[key] -= 1
        if not _waiters[key]:
            del _waiters[key]
            await blocking.connection_pool.disconnect(inuse_connections=False)


def _client(alias: str, role: str, timeout: float) -> Any:
    """The cached asyncio client of ``alias`` for ``role`` in the running loop."""
    loop = asyncio.get_running_loop()
    per_loop = _clients.get(loop)
    if per_loop is None:
        per_loop = _new_loop(loop)
    found = per_loop.get((alias, role))
    if found is None:
        found = _made(alias, timeout, grow=role == "blocking")
        per_loop[(alias, role)] = found
    return found


def _new_loop(loop: asyncio.AbstractEventLoop) -> dict[tuple[str, str], Any]:
    """The (empty) client cache of ``loop``, which has none yet. The caches of loops closed
    meanwhile are dropped first: a closed loop can run nothing, so its connections cannot be
    closed by awaiting; dropped, they close as garbage (a closed loop is never reused)."""
    for other in list(_clients):  # a copy: loops in other threads add theirs meanwhile
        if other.is_closed():
            _clients.pop(other, None)
    per_loop: dict[tuple[str, str], Any] = {}
    _clients[loop] = per_loop
    return per_loop


def _made(alias: str, timeout: float, *, grow: bool) -> Any:
    """A ``redis.asyncio.Redis`` on the server of ``alias``'s base client (see the module docs;
    with ``grow``: one connection per concurrent caller)."""
    base = connection(alias)
    pool = getattr(base, "connection_pool", None)
    if is_cluster(base) or pool is None or _is_sentinel(pool):
        raise JoblockConfigError(
            f"alock(): cache {alias!r} is a Redis Cluster or Sentinel connection; the asyncio "
            "locks support one Redis server (TCP, TLS or a unix socket). Use lock() in a "
            "thread: await sync_to_async(work_under_lock, thread_sensitive=False)()"
        )
    connection_class = _async_class(alias, pool.connection_class)
    accepted = _accepted_arguments(connection_class)
    kwargs = {
        name: value
        for name, value in pool.connection_kwargs.items()
        if name in accepted and name not in _NOT_INHERITED
    }
    kwargs.update(own_options(timeout))
    kwargs.update(retry=AsyncRetry(NoBackoff(), 0), connection_class=connection_class)
    if grow:
        return redis.asyncio.Redis(connection_pool=redis.asyncio.ConnectionPool(**kwargs))
    new_pool = redis.asyncio.BlockingConnectionPool(
        max_connections=POOL_SIZE, timeout=timeout, **kwargs
    )
    return redis.asyncio.Redis(connection_pool=new_pool)


def _is_sentinel(pool: Any) -> bool:
    from redis.sentinel import SentinelConnectionPool

    return isinstance(pool, SentinelConnectionPool)


def _async_class(alias: str, sync_class: type) -> type:
    for sync, asynchronous in _CONNECTION_CLASSES:
        if issubclass(sync_class, sync):
            return asynchronous
    raise JoblockConfigError(
        f"alock(): cache {alias!r} connects with {sync_class.__qualname__}, which redis-py's "
        "asyncio client has no twin of (Connection, SSLConnection, UnixDomainSocketConnection)"
    )


def _accepted_arguments(connection_class: type) -> set[str]:
    """The keyword arguments ``connection_class`` and its bases take."""
    names: set[str] = set()
    for klass in connection_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names.update(inspect.signature(init).parameters)
    return names


async def run_script(found: Any, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """``script`` on the asyncio client ``found``, as :class:`~.backend.Script` runs it."""
    try:
        return await found.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        return await found.eval(script.source, len(keys), *keys, *args)


async def send(found: Any, calls: Sequence[Call]) -> list[Any]:
    """:func:`~.backend.send` on the asyncio client ``found`` (one server: ``extra`` is simply
    more calls)."""
    if len(calls) == 1:
        call = calls[0]
        try:
            if isinstance(call, tuple) and isinstance(call[0], Script):
                return [await run_script(found, call[0], call[1], call[2])]
            return [await found.execute_command(*call)]
        except ResponseError as exc:
            return [exc]
    replies: list[Any] = await pipeline(found, calls).execute(raise_on_error=False)
    for index in forgotten(calls, replies):
        script, keys, args = calls[index]
        replies[index] = await run_script(found, script, keys, args)
    return replies


async def drive(steps: Steps[T], found: Any, blocking: Any = None) -> T:
    """:func:`.redis_steps.drive` on the asyncio clients: the flow's calls are awaited, so a
    waiting acquire never blocks the loop, and a cancelled task is cancelled at its step."""
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = advance(steps, reply, error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            if isinstance(step, Send):
                reply = await send(found, [*step.calls, *step.extra])
            elif isinstance(step, RunScript):
                reply = await run_script(found, step.script, step.keys, step.args)
            else:
                reply = await blocking.blpop([step.key], timeout=step.timeout)
            error = None
        except BaseException as exc:  # noqa: BLE001 - thrown into the flow, which decides
            reply = None
            error = exc

"""The Redis clients of django-joblock, its scripts' runner, and what a Redis failure means.

The *base* of an alias is django-redis' ``get_redis_connection(alias, write=True)`` (never
``cache.lock()``), or the ``RedisCluster`` that ``JOBLOCK["REDIS_CLIENT"]`` makes. The locks
never send on it but on dedicated clients made with redis-py's public constructors from its
connection class and arguments (TLS, passwords, Sentinel, Cluster carry over):

- :func:`client`: :data:`POOL_SIZE` connections that callers wait for, sockets timing out
  after ``JOBLOCK["REDIS_TIMEOUT"]`` (less for short-TTL renewals), no retries: Redis not
  answering raises within the timeout, and the user's pool is never starved. A connection
  the server closed while idle is replaced before the next command is sent;
- :func:`blocking_client`: a connection per blocked waiter (``BLPOP``), its socket timeout
  longer than any block.

Cached per alias, dropped when ``CACHES`` or ``JOBLOCK`` change; redis-py's pools make new
connections in a forked child.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import redis
from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string
from django_redis import get_redis_connection
from redis import exceptions as redis_exceptions
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from . import conf
from .exceptions import JoblockConfigError, LockBackendUnavailable

POOL_SIZE = 16  # connections per alias for commands; more concurrent callers wait for one
MAX_BLOCK = 1.0  # longest single BLPOP of a waiting acquire, seconds

# Redis Cluster's "cannot serve you now": a node down (CLUSTERDOWN, redis-py drops the prefix),
# a slot moving (TRYAGAIN; ClusterError when MOVED/ASK rounds exhaust redis-py's TTL), no node.
_CLUSTER_NAMES = (
    "ClusterError",
    "TryAgainError",
    "SlotNotCoveredError",
    "RedisClusterUnreachableError",  # redis-py >= 5.1
)
_CLUSTER_UNAVAILABLE = tuple(
    getattr(redis_exceptions, name) for name in _CLUSTER_NAMES if hasattr(redis_exceptions, name)
)
REDIS_ERRORS = (
    RedisConnectionError,
    RedisTimeoutError,
    ResponseError,
    OSError,
    *_CLUSTER_UNAVAILABLE,
)
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
# redis-py maps some of those replies to classes of their own (without the prefix).
_UNAVAILABLE_CLASSES = (
    redis_exceptions.OutOfMemoryError,
    redis_exceptions.BusyLoadingError,
    redis_exceptions.ReadOnlyError,
    *_CLUSTER_UNAVAILABLE,
)

_bases: dict[str, Any] = {}
_clients: dict[tuple[str, float, str], Any] = {}
_guard = threading.Lock()


def connection(alias: str) -> Any:
    """The base client of ``alias`` (see the module docs); raises on a bad alias."""
    base = _bases.get(alias)
    if base is None:
        current = conf.get()
        factory = current.REDIS_CLIENT if alias == current.REDIS_ALIAS else None
        base = cache_connection(alias) if factory is None else client_from_factory(factory)
        _bases[alias] = base
    return base


def cache_argument(cache: str | None, using: str | None) -> str | None:
    """The cache alias a caller chose: ``cache=``, or ``using=``, its old name (deprecated: in
    Django ``using`` names a database), with a ``DeprecationWarning`` at the caller's call."""
    if using is None:
        return cache
    if cache is not None:
        raise TypeError(f"give the cache alias once: cache={cache!r} or using={using!r}")
    message = "using= is deprecated for a lock's cache alias: pass cache= (using= names databases)"
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    return using


def client(alias: str | None = None, timeout: float | None = None) -> Any:
    """The command client of ``alias`` (default ``REDIS_ALIAS``, the locks' own): sockets time
    out after ``timeout`` s (default ``REDIS_TIMEOUT``)."""
    settings = conf.get()
    alias = alias or settings.REDIS_ALIAS
    timeout = timeout or settings.REDIS_TIMEOUT
    return _dedicated(alias, timeout, "commands")


def renewal_client(alias: str | None = None, timeout: float | None = None) -> Any:
    """:func:`client` for the renewal thread, a client object of its own: redis-py 5's Redis
    Cluster client, on a node's connection error, disconnects every connection of its nodes'
    pools, those other threads are reading from included (CI: a release failed with "I/O
    operation on closed file" while a node was down)."""
    settings = conf.get()
    return _dedicated(alias or settings.REDIS_ALIAS, timeout or settings.REDIS_TIMEOUT, "renewal")


def blocking_client(alias: str) -> Any:
    """The client waiting acquires block on: its sockets outlast any ``BLPOP`` block."""
    return _dedicated(alias, MAX_BLOCK + conf.get().REDIS_TIMEOUT, "blocking")


def _dedicated(alias: str, timeout: float, role: str) -> Any:
    """The cached client of ``alias`` with ``timeout``-second sockets for ``role``: "commands",
    "renewal" or "blocking" (one connection per concurrent caller)."""
    key = (alias, timeout, role)
    found = _clients.get(key)
    if found is None:
        with _guard:
            found = _clients.get(key)
            if found is None:
                found = dedicated(connection(alias), timeout, grow=role == "blocking")
                _clients[key] = found
    return found


def dedicated(base: Any, timeout: float, *, grow: bool = False) -> Any:
    """A client on ``base``'s server(s): ``timeout``-second sockets, no retries, and
    :data:`POOL_SIZE` connections callers wait for (with ``grow``: one per concurrent caller)."""
    overrides: dict[str, Any] = {**own_options(timeout), "retry": Retry(NoBackoff(), 0)}
    if is_cluster(base):
        from redis.cluster import ClusterNode

        kwargs = {
            name: value
            for name, value in base.nodes_manager.connection_kwargs.items()
            if name not in _CLUSTER_OWN_KWARGS
        }
        if int(redis.__version__.split(".")[0]) < 6:
            overrides["cluster_error_retry_attempts"] = 0  # 5.x counts retries here
        nodes = [ClusterNode(n.host, n.port) for n in base.get_nodes()]  # type: ignore[no-untyped-call]
        return redis.RedisCluster(startup_nodes=nodes, **{**kwargs, **overrides})
    pool = base.connection_pool
    kwargs = {**pool.connection_kwargs, **overrides, "connection_class": pool.connection_class}
    for retries in ("retry_on_error", "retry_on_timeout"):  # no retries: ``retry`` says so
        kwargs.pop(retries, None)
    if grow:
        return redis.Redis(connection_pool=redis.ConnectionPool(**kwargs))
    new_pool = redis.BlockingConnectionPool(max_connections=POOL_SIZE, timeout=timeout, **kwargs)  # type: ignore[no-untyped-call]
    return redis.Redis(connection_pool=new_pool)


def own_options(timeout: float) -> dict[str, Any]:
    """The connection options of the locks' own clients, sync and asyncio (with a retry policy
    of none, each its own client's class): ``timeout``-second sockets, no health checks."""
    return {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "health_check_interval": 0,
        "client_name": "joblock",  # what CLIENT LIST shows for the locks' connections
    }


# Arguments RedisCluster puts among its nodes' connection arguments itself (bound to that
# client, or its retry policy): a new client must not inherit them.
_CLUSTER_OWN_KWARGS = frozenset(
    {
        "host",
        "port",
        "retry",
        "retry_on_error",
        "retry_on_timeout",
        "redis_connect_func",
        "oss_cluster_maint_notifications_handler",
        "maint_notifications_config",
    }
)


def forget() -> None:
    """Drop the cached clients (after a settings change), closing the dedicated ones."""
    with _guard:
        dropped = list(_clients.values())
        _clients.clear()
        _bases.clear()
    for each in dropped:
        close(each)


@receiver(setting_changed)
def _on_setting_changed(setting: str, **kwargs: Any) -> None:
    if setting in ("JOBLOCK", "CACHES"):
        forget()


def client_from_factory(path: str) -> Any:
    """The client made by the factory at dotted ``path`` (``JOBLOCK["REDIS_CLIENT"]``).

    Raises :class:`JoblockConfigError` naming the setting when the factory cannot be imported
    or called, raises, or returns no redis-py client; :class:`LockBackendUnavailable` when it
    raised because Redis did not answer (a ``RedisCluster`` asks for the slot map when made)."""
    what = f"JOBLOCK['REDIS_CLIENT'] = {path!r}"
    try:
        factory = import_string(path)
    except ImportError as exc:
        raise JoblockConfigError(f"{what} cannot be imported: {exc}") from exc
    if not callable(factory):
        raise JoblockConfigError(f"{what} is not callable (a {type(factory).__name__})")
    try:
        made = factory()
    except Exception as exc:
        if is_unavailable(exc) or "cannot be connected" in str(exc):
            raise LockBackendUnavailable(f"{what} could not reach Redis: {exc}") from exc
        raise JoblockConfigError(f"{what} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(made, (redis.Redis, redis.RedisCluster)):
        raise JoblockConfigError(
            f"{what} returned {type(made).__name__}, not a redis-py client "
            "(redis.Redis or redis.cluster.RedisCluster)"
        )
    return made


def cache_connection(alias: str) -> Any:
    """The django-redis connection of cache ``alias`` (write side), never the
    ``REDIS_CLIENT`` factory's: what RQ queues without django-rq use."""
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


def text(reply: Any) -> str:
    """A Redis reply (bytes, or str with ``decode_responses``) as text."""
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def is_unavailable(exc: BaseException) -> bool:
    """True when ``exc`` means Redis could not serve the request (down, timeout, OOM...)."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError, *_UNAVAILABLE_CLASSES)):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(_UNAVAILABLE_PREFIXES)


def no_answer(exc: BaseException) -> str:
    """What the commands and views say when Redis did not answer (one of ``REDIS_ERRORS``)."""
    return f"Redis does not answer: {type(exc).__name__}: {exc}"


def unavailable(
    exc: BaseException, action: str, *, resource: str, key: str, owner: str
) -> LockBackendUnavailable:
    """The :class:`LockBackendUnavailable` to raise for ``exc`` (one of ``REDIS_ERRORS``), as
    ``raise unavailable(exc, ...) from exc``. Re-raises ``exc`` itself when it is not about
    availability (a WRONGTYPE reply: a bug or a foreign key in our namespace, never "down")."""
    if not is_unavailable(exc):
        raise exc
    return LockBackendUnavailable(
        f"Redis unavailable while trying to {action}: {type(exc).__name__}: {exc}",
        resource=resource,
        key=key,
        owner=owner,
    )


def is_cluster(found: object) -> bool:
    """True for a Redis Cluster client."""
    kind = type(found)
    known = _cluster_classes.get(kind)
    if known is None:
        # Once per class: isinstance() of RedisCluster, an ABC, runs two Python-level checks,
        # and every acquire and release asks.
        known = issubclass(kind, redis.RedisCluster)
        _cluster_classes[kind] = known
    return known


_cluster_classes: dict[type, bool] = {}


def close(found: Any) -> None:
    """Close a client's connections."""
    with contextlib.suppress(*REDIS_ERRORS):
        found.close() if is_cluster(found) else found.connection_pool.disconnect()


def server_infos(found: Any, section: str) -> dict[str, dict[str, Any]]:
    """``INFO section`` of every server behind a client, by ``host:port``: the one server of a
    plain client, every primary of a Redis Cluster (each asked on its own)."""
    if not is_cluster(found):
        kwargs = found.connection_pool.connection_kwargs
        name = str(kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port')}")
        return {name: found.info(section)}
    return {node.name: found.info(section, target_nodes=node) for node in found.get_primaries()}


class Script:
    """A Lua script, sent by ``EVALSHA``; by ``EVAL`` when the server does not know it (a restart,
    ``SCRIPT FLUSH``, a failover), which also caches it there. ``EVAL`` goes to the node of the
    keys on Redis Cluster, where redis-py's ``SCRIPT LOAD`` goes to every primary: one of them
    down would fail the script everywhere."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, found: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run the script on client ``found`` (one round trip; two after a ``NOSCRIPT``)."""
        try:
            return found.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return found.eval(self.source, len(keys), *keys, *args)


# One command of a round trip: a script call, or a plain command's arguments.
Call = tuple[Script, Sequence[str], Sequence[Any]] | Sequence[Any]


def send(found: Any, calls: Sequence[Call], extra: Sequence[Call] = ()) -> list[Any]:
    """Several commands in one round trip (a pipeline without ``MULTI``; on Redis Cluster each
    command goes to the node of its key): one reply per call, in order. A command the server
    refused gives its exception as its reply (the others still ran); a script the server had
    forgotten is loaded and run again on its own. A connection error raises (it is not known
    which commands ran).

    ``extra`` (index entries, metrics: bookkeeping a lock must not fail for) rides in the same
    round trip on one server; on Redis Cluster, where it lives on other nodes, it follows in a
    round trip of its own, and an error there becomes its replies (never raised)."""
    if extra and is_cluster(found):
        first = send(found, calls) if calls else []
        try:
            return [*first, *send(found, extra)]
        except REDIS_ERRORS as exc:
            return [*first, *[exc] * len(extra)]
    calls = [*calls, *extra]
    if len(calls) == 1:  # no pipeline: redis-py's costs more than the command itself
        call = calls[0]
        try:
            if isinstance(call, tuple) and isinstance(call[0], Script):
                return [call[0](found, call[1], call[2])]
            return [found.execute_command(*call)]
        except ResponseError as exc:
            return [exc]
    replies: list[Any] = pipeline(found, calls).execute(raise_on_error=False)
    for index in forgotten(calls, replies):
        script, keys, args = calls[index]
        replies[index] = script(found, keys, args)
    return replies


def pipeline(found: Any, calls: Sequence[Call]) -> Any:
    """A pipeline (without ``MULTI``) of the client ``found``, sync or asyncio, with ``calls``
    queued: scripts by ``EVALSHA``."""
    pipe = found.pipeline(transaction=False)
    for call in calls:
        if isinstance(call, tuple) and isinstance(call[0], Script):
            script, keys, args = call
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        else:
            pipe.execute_command(*call)
    return pipe


def forgotten(calls: Sequence[Call], replies: list[Any]) -> list[int]:
    """The positions of the script calls among ``calls`` whose reply in ``replies`` says the
    server had forgotten the script (to be run again on their own)."""
    return [
        index
        for index, call in enumerate(calls)
        if isinstance(replies[index], NoScriptError) and isinstance(call, tuple)
    ]

"""The Redis connection behind the locks, and the mapping of Redis failures to one exception.

The connection is django-redis' ``get_redis_connection(alias, write=True)`` (never
``cache.lock()``), or, for the ``REDIS_ALIAS`` alias when ``JOBLOCK["REDIS_CLIENT"]`` names a
factory, the client that factory returns (a ``RedisCluster``: django-redis has no Cluster
client). The lock scripts go through the lean command path of
:mod:`django_joblock.lean` on that client's server. The renewal thread gets its *own* client on
the same server with short socket timeouts and no client-side retries
(:func:`renewal_client`), because redis-py's defaults can block for about a minute on a
black-holed server, far past the lock's TTL.
"""

from __future__ import annotations

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
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from . import conf, lean
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
    lean.forget()


@receiver(setting_changed)
def _on_setting_changed(setting: str, **kwargs: Any) -> None:
    # JOBLOCK names the alias (REDIS_ALIAS), CACHES where it points.
    if setting in ("JOBLOCK", "CACHES"):
        forget_connections()


def _lookup(alias: str) -> Any:
    current = conf.get()
    if current.REDIS_CLIENT is not None and alias == current.REDIS_ALIAS:
        return client_from_factory(current.REDIS_CLIENT)
    return cache_connection(alias)


def client_from_factory(path: str) -> Any:
    """The client made by the factory at dotted ``path`` (``JOBLOCK["REDIS_CLIENT"]``).

    Raises :class:`JoblockConfigError` naming the setting when it cannot be imported, is not
    callable, raises, or returns something that is not a redis-py client; and
    :class:`LockBackendUnavailable` when it raised because Redis did not answer (a
    ``RedisCluster`` asks its nodes for the slot map when it is made): a server that is down is
    not a configuration error.
    """
    what = f"JOBLOCK['REDIS_CLIENT'] = {path!r}"
    try:
        factory = import_string(path)
    except ImportError as exc:
        raise JoblockConfigError(f"{what} cannot be imported: {exc}") from exc
    if not callable(factory):
        raise JoblockConfigError(f"{what} is not callable (a {type(factory).__name__})")
    try:
        client = factory()
    except Exception as exc:
        # RedisCluster(...) reports nodes that do not answer as RedisClusterException.
        if is_unavailable(exc) or "cannot be connected" in str(exc):
            raise LockBackendUnavailable(f"{what} could not reach Redis: {exc}") from exc
        raise JoblockConfigError(f"{what} raised {type(exc).__name__}: {exc}") from exc
    if not callable(getattr(client, "execute_command", None)):
        raise JoblockConfigError(
            f"{what} returned {type(client).__name__}, not a redis-py client "
            "(redis.Redis or redis.cluster.RedisCluster)"
        )
    return client


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


REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, ResponseError, OSError)


def no_answer(exc: BaseException) -> str:
    """What the commands and views say when Redis did not answer (one of ``REDIS_ERRORS``)."""
    return f"Redis does not answer: {type(exc).__name__}: {exc}"


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


def is_cluster(client: Any) -> bool:
    """True for a Redis Cluster client."""
    return isinstance(client, redis.RedisCluster)


def renewal_client(base: Any, timeout: float) -> Any:
    """A client on ``base``'s server with ``timeout``-second sockets and no retries.

    On a Sentinel-managed pool its connections still ask the sentinels for the primary (they
    share the pool's ``connection_pool`` argument); on Redis Cluster it is a new
    ``RedisCluster`` on the same nodes, which routes each key to its node.
    """
    if is_cluster(base):
        return _cluster_renewal_client(base, timeout)
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


# Arguments redis-py's RedisCluster puts among its nodes' connection arguments itself (bound
# to that client, or its retry policy): a new client must not inherit them.
_CLUSTER_OWN_KWARGS = (
    "host",
    "port",
    "retry",
    "retry_on_error",
    "retry_on_timeout",
    "redis_connect_func",
    "oss_cluster_maint_notifications_handler",
    "maint_notifications_config",
)
# redis-py >= 6 retries cluster commands by its ``retry`` object; 5.x counts them with
# ``cluster_error_retry_attempts`` and gives ``retry`` to the nodes' connections.
_CLUSTER_RETRY_OBJECT = int(redis.__version__.split(".")[0]) >= 6


def _cluster_renewal_client(base: Any, timeout: float) -> Any:
    from redis.cluster import ClusterNode

    kwargs = dict(base.nodes_manager.connection_kwargs)
    for name in _CLUSTER_OWN_KWARGS:
        kwargs.pop(name, None)
    kwargs.update(socket_timeout=timeout, socket_connect_timeout=timeout, health_check_interval=0)
    kwargs.update(retry=Retry(NoBackoff(), 0))
    if not _CLUSTER_RETRY_OBJECT:
        kwargs.update(cluster_error_retry_attempts=0)
    nodes = [ClusterNode(node.host, node.port) for node in base.get_nodes()]  # type: ignore[no-untyped-call]
    return redis.RedisCluster(startup_nodes=nodes, **kwargs)


def close(client: Any) -> None:
    """Close ``client``'s connections (a short-lived client made by :func:`renewal_client`)."""
    if is_cluster(client):
        client.close()
    else:
        client.connection_pool.disconnect()


def server_infos(client: Any, section: str) -> dict[str, dict[str, Any]]:
    """``INFO section`` of every server behind ``client``, by ``host:port``: the one server of
    a plain client, every primary of a Redis Cluster (each asked on its own)."""
    if not is_cluster(client):
        kwargs = client.connection_pool.connection_kwargs
        name = f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
        if kwargs.get("path"):
            name = str(kwargs["path"])
        return {name: client.info(section)}
    return {node.name: client.info(section, target_nodes=node) for node in client.get_primaries()}

"""Which RQ queue a name means: with django-rq, a name in ``settings.RQ_QUEUES`` (an unknown
one raises :class:`~django_joblock.exceptions.JoblockConfigError`, never silently another
Redis); without it, an ``rq.Queue`` on ``JOBLOCK["REDIS_ALIAS"]``'s connection. RQ's state lives
on the *queue's* connection, which may differ from the locks'."""

from __future__ import annotations

import inspect
from typing import Any

from django.apps import apps
from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver
from rq import Queue

from .. import conf
from ..backend import cache_connection
from ..exceptions import JoblockConfigError

# django-rq's get_queue arguments per RQ_QUEUES name, its client included: django-rq builds a
# new one per call (a new pool; on SENTINELS a lookup of the primary) for every .delay().
_arguments: dict[str, dict[str, Any]] = {}


@receiver(setting_changed)
def _forget_connections(setting: str, **kwargs: Any) -> None:
    if setting in ("RQ_QUEUES", "CACHES"):
        _arguments.clear()


def configured_names() -> list[str]:
    """The names in ``settings.RQ_QUEUES`` (empty without django-rq)."""
    if not apps.is_installed("django_rq"):
        return []
    return sorted(getattr(settings, "RQ_QUEUES", None) or {})


def get_queue(queue: Any) -> Queue:
    """``queue`` (an ``rq.Queue`` or a name, resolved) as an ``rq.Queue`` (module docs)."""
    if isinstance(queue, Queue):
        return queue
    if not isinstance(queue, str) or not queue:
        raise ValueError(f"queue must be a queue name or an rq.Queue, got {queue!r}")
    if not apps.is_installed("django_rq"):
        return Queue(queue, connection=cache_connection(conf.get().REDIS_ALIAS))
    known = configured_names()
    if queue not in known:
        names = ", ".join(known) or "none"
        raise JoblockConfigError(f"Queue {queue!r} is not in settings.RQ_QUEUES (known: {names})")
    import django_rq  # type: ignore[import-not-found,unused-ignore]

    arguments = _arguments.get(queue)
    if arguments is None:
        # When to enqueue is @locked_job's own (on_commit=): django-rq's COMMIT_MODE (4.x:
        # "on_db_commit") would defer it a second time and hand the caller None for the job.
        at_once = "commit_mode" in inspect.signature(django_rq.get_queue).parameters
        mode = {"commit_mode": "auto"} if at_once else {"autocommit": True}
        arguments = {"connection": django_rq.get_connection(queue), **mode}
        _arguments[queue] = arguments
    return django_rq.get_queue(queue, **arguments)  # type: ignore[no-any-return,unused-ignore]


def queue_name(queue: Any) -> str:
    return str(queue.name) if isinstance(queue, Queue) else str(queue)


def server_of(client: Any) -> tuple[Any, ...]:
    """Identity of the Redis server *and database* a client talks to (for grouping reads); a
    Sentinel-managed pool is named by its service (its host changes with each failover)."""
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", {}) or {}
    where = (kwargs.get("host"), kwargs.get("port"), kwargs.get("path"), kwargs.get("db", 0))
    return (getattr(pool, "service_name", None), *where, kwargs.get("username"))

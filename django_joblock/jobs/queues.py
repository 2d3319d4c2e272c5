"""Which RQ queue a name means. With django-rq installed a name must be in
``settings.RQ_QUEUES`` (``django_rq.get_queue``, its connection and on-commit mode respected);
an unknown one raises :class:`~django_joblock.exceptions.JoblockConfigError` listing the known
ones, instead of silently using another Redis. Without django-rq a name is an ``rq.Queue`` on
the connection of ``JOBLOCK["REDIS_ALIAS"]``. RQ's state lives on the *queue's* connection,
which may differ from the locks'.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.conf import settings
from rq import Queue

from .. import conf
from ..backend import cache_connection
from ..exceptions import JoblockConfigError


def configured_names() -> list[str]:
    """The names in ``settings.RQ_QUEUES`` (empty without django-rq)."""
    if not apps.is_installed("django_rq"):
        return []
    return sorted(getattr(settings, "RQ_QUEUES", None) or {})


def get_queue(queue: Any) -> Queue:
    """``queue`` as an ``rq.Queue``: a Queue as is, a name resolved (``ValueError`` for
    something else, :class:`~django_joblock.exceptions.JoblockConfigError` for a name
    django-rq does not know)."""
    if isinstance(queue, Queue):
        return queue
    if not isinstance(queue, str) or not queue:
        raise ValueError(f"queue must be a queue name or an rq.Queue, got {queue!r}")
    if not apps.is_installed("django_rq"):
        return Queue(queue, connection=cache_connection(conf.get().REDIS_ALIAS))
    known = configured_names()
    if queue not in known:
        raise JoblockConfigError(
            f"Queue {queue!r} is not in settings.RQ_QUEUES (known: {', '.join(known) or 'none'}). "
            "django-rq is installed, so django-joblock takes its queues from RQ_QUEUES; add "
            "the queue there or use one of the known names."
        )
    import django_rq  # type: ignore[import-not-found,unused-ignore]

    found: Queue = django_rq.get_queue(queue)
    return found


def queue_name(queue: Any) -> str:
    return str(queue.name) if isinstance(queue, Queue) else str(queue)


def server_of(client: Any) -> tuple[Any, ...]:
    """Identity of the Redis server *and database* a client talks to (for grouping reads); a
    Sentinel-managed pool is named by its service (its host changes with each failover)."""
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", {}) or {}
    return (
        getattr(pool, "service_name", None),
        kwargs.get("host"),
        kwargs.get("port"),
        kwargs.get("path"),
        kwargs.get("db", 0),
        kwargs.get("username"),
    )

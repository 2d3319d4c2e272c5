"""Which RQ queue a name means, and where RQ keeps its state for it.

With django-rq in ``INSTALLED_APPS`` a name must be one of ``settings.RQ_QUEUES``: the queue
comes from ``django_rq.get_queue`` (so its connection settings and on-commit enqueue mode are
respected). A name missing there raises :class:`~django_joblock.exceptions.JoblockConfigError`
listing the known names, as django-rq's own ``rqworker`` refuses it, instead of silently
using another Redis. Without django-rq, a name is an ``rq.Queue`` on the django-redis
connection of ``JOBLOCK["REDIS_ALIAS"]``.

RQ's state (jobs, workers, registries, the scheduler lock) lives on the *queue's* connection,
which may be another database or another server than the locks'. Readers go through
:func:`get_queue` and RQ's own key helpers (``Job.key_for``, the worker key prefix), which
follow rq 3's ``RQ_KEY_PREFIX``.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.conf import settings
from rq import Queue

from .. import conf
from ..backend import cache_connection
from ..exceptions import JoblockConfigError


def django_rq_installed() -> bool:
    return apps.is_installed("django_rq")


def configured_names() -> list[str]:
    """The names in ``settings.RQ_QUEUES`` (empty without django-rq)."""
    if not django_rq_installed():
        return []
    return sorted(getattr(settings, "RQ_QUEUES", None) or {})


def uses_django_rq(name: str) -> bool:
    """True when ``name`` is resolved through django-rq."""
    return django_rq_installed() and name in (getattr(settings, "RQ_QUEUES", None) or {})


def check_name(name: object) -> str:
    """``name`` if it names a queue this project can resolve, else a clear exception."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"queue must be a queue name or an rq.Queue, got {name!r}")
    if django_rq_installed() and not uses_django_rq(name):
        known = ", ".join(configured_names()) or "none"
        raise JoblockConfigError(
            f"Queue {name!r} is not in settings.RQ_QUEUES (known: {known}). django-rq is "
            "installed, so django-joblock takes its queues from RQ_QUEUES; add the queue "
            "there or use one of the known names."
        )
    return name


def get_queue(queue: Any) -> Queue:
    """``queue`` as an ``rq.Queue``: a Queue is returned as is, a name is resolved.

    Raises ``ValueError`` for something that is not a name, and
    :class:`~django_joblock.exceptions.JoblockConfigError` for a name django-rq does not know.
    """
    if isinstance(queue, Queue):
        return queue
    name = check_name(queue)
    if django_rq_installed():
        import django_rq  # type: ignore[import-not-found,unused-ignore]

        found: Queue = django_rq.get_queue(name)
        return found
    return Queue(name, connection=cache_connection(conf.get().REDIS_ALIAS))


def queue_name(queue: Any) -> str:
    return str(queue.name) if isinstance(queue, Queue) else str(queue)


def server_of(client: Any) -> tuple[Any, ...]:
    """Identity of the Redis server *and database* a client talks to (for grouping reads).

    A Sentinel-managed pool is named by its service (its host changes with each failover).
    """
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

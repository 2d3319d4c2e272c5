"""Which RQ queue a name means: django-rq's ``RQ_QUEUES`` when installed, else our own.

With django-rq in ``INSTALLED_APPS`` and the name in ``settings.RQ_QUEUES``, the queue comes
from ``django_rq.get_queue`` (so its connection settings and its on-commit enqueue mode are
respected). Otherwise it is an ``rq.Queue`` on the django-redis connection of
``JOBLOCK["REDIS_ALIAS"]``.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.conf import settings
from rq import Queue

from . import conf
from .backend import connection


def uses_django_rq(name: str) -> bool:
    return apps.is_installed("django_rq") and name in getattr(settings, "RQ_QUEUES", {})


def get_queue(queue: Any) -> Queue:
    """``queue`` as an ``rq.Queue``: a Queue is returned as is, a name is resolved."""
    if isinstance(queue, Queue):
        return queue
    if not isinstance(queue, str) or not queue:
        raise ValueError(f"queue must be a queue name or an rq.Queue, got {queue!r}")
    if uses_django_rq(queue):
        import django_rq  # type: ignore[import-not-found,unused-ignore]

        found: Queue = django_rq.get_queue(queue)
        return found
    return Queue(queue, connection=connection(conf.get().REDIS_ALIAS))


def queue_name(queue: Any) -> str:
    return str(queue.name) if isinstance(queue, Queue) else str(queue)

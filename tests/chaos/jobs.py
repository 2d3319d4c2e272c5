"""The chaos job: a deliberately racy read-modify-write of one resource's balance.

``apply`` is the safe version (lock + idempotency + fencing); ``apply_unsafe`` is the negative
control: the same lock, but no idempotency key and a plain UPDATE instead of the fence. Both
wait for a busy resource parked by admission (the default); their ``_direct`` twins are the
same jobs with ``admission=False``: holders outside admission, which requeue on contention and
take a lock that expired under a paused holder (what the fence is for). The Tasks phase runs
the same bodies as Django tasks on django-joblock's RQ backend: ``apply_task`` (and its
``_direct`` twin) with ``@locked_task``, and the negative control ``apply_plain_task``, a plain
``@task`` (no lock, no idempotency, no fence).
"""

from __future__ import annotations

import os
import time

from django.db import transaction
from django_redis import get_redis_connection
from rq import Retry

from django_joblock import current_lock, fenced_update, locked_job, locked_task

try:  # Django >= 6.0
    from django.tasks import task
except ImportError:  # Django 5.2: the django-tasks backport
    from django_tasks import task  # type: ignore[no-redef,unused-ignore]

from .models import Balance, Effect

TTL = 2.0
WORK = float(os.environ.get("CHAOS_WORK", "0.02"))


def _started() -> None:
    get_redis_connection("default").rpush("chaos:started", os.getpid())


@locked_job("chaos", lock="acct:{resource}", idempotency_key="chaos:{logical_id}", ttl=TTL)
def apply(resource: str, logical_id: str, delta: int) -> int:
    return _apply(resource, logical_id, delta)


@locked_job(
    "chaos",
    lock="acct:{resource}",
    idempotency_key="chaos:{logical_id}",
    ttl=TTL,
    admission=False,
)
def apply_direct(resource: str, logical_id: str, delta: int) -> int:
    return _apply(resource, logical_id, delta)


# As the RQ phases enqueue their jobs: retried when a work horse dies, and a short job_timeout
# lets RQ's registry cleanup hand the task of a worker that died with Redis to another.
TASK_RQ = {"retry": Retry(max=5, interval=1), "job_timeout": 20, "queue_name": "chaos"}


@locked_task(lock="acct:{resource}", idempotency_key="chaos:{logical_id}", ttl=TTL, **TASK_RQ)
def apply_task(resource: str, logical_id: str, delta: int) -> int:
    return _apply(resource, logical_id, delta)


@locked_task(
    lock="acct:{resource}",
    idempotency_key="chaos:{logical_id}",
    ttl=TTL,
    admission=False,
    **TASK_RQ,
)
def apply_task_direct(resource: str, logical_id: str, delta: int) -> int:
    return _apply(resource, logical_id, delta)


def _apply(resource: str, logical_id: str, delta: int) -> int:
    _started()
    balance = Balance.objects.get(name=resource)  # read ...
    time.sleep(WORK)  # ... widen the window ...
    held = current_lock()
    assert held is not None and held.fence is not None
    fenced_update(
        Balance.objects.filter(pk=balance.pk), held.fence, value=balance.value + delta
    )  # ... write, refused if a newer holder wrote
    Effect.objects.create(logical_id=logical_id, resource=resource, delta=delta, fence=held.fence)
    return delta


# atomic=False: the negative control keeps its own transaction, committed whether or not the
# lock is still held (the job transaction's ensure_held() would otherwise hide some damage).
@locked_job("chaos", lock="acct:{resource}", ttl=TTL, atomic=False)
def apply_unsafe(resource: str, logical_id: str, delta: int) -> int:
    return _apply_unsafe(resource, logical_id, delta)


@locked_job("chaos", lock="acct:{resource}", ttl=TTL, atomic=False, admission=False)
def apply_unsafe_direct(resource: str, logical_id: str, delta: int) -> int:
    return _apply_unsafe(resource, logical_id, delta)


def _apply_unsafe(resource: str, logical_id: str, delta: int) -> int:
    _started()
    with transaction.atomic():
        balance = Balance.objects.get(name=resource)
        time.sleep(WORK)
        Balance.objects.filter(pk=balance.pk).update(value=balance.value + delta)
        Effect.objects.create(logical_id=logical_id, resource=resource, delta=delta, fence=None)
    return delta


@task(queue_name="chaos")
def apply_plain_task(resource: str, logical_id: str, delta: int) -> int:
    """The Tasks phase's negative control: a plain Django task on the same backend."""
    return _apply_unsafe(resource, logical_id, delta)

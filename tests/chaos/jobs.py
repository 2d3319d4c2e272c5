"""The chaos job: a deliberately racy read-modify-write of one resource's balance.

``apply`` is the safe version (lock + idempotency + fencing); ``apply_unsafe`` is the negative
control: the same lock, but no idempotency key and a plain UPDATE instead of the fence. Both
wait for a busy resource parked by admission (the default); their ``_direct`` twins are the
same jobs with ``admission=False``: holders outside admission, which requeue on contention and
take a lock that expired under a paused holder (what the fence is for).
"""

from __future__ import annotations

import os
import time

from django.db import transaction
from django_redis import get_redis_connection

from django_joblock import current_lock, fenced_update, locked_job

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

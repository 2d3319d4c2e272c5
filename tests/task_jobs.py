"""Django tasks the tests enqueue (importable by worker processes): ``@locked_task`` on the RQ
backend (alias "rq"), the immediate one ("default") and the database one ("db")."""

from __future__ import annotations

import os
import time
from typing import Any

from django_redis import get_redis_connection

from django_joblock import current_lock, locked_task
from tests import jobs


def _credit(name: str, credit_id: str, amount: int, seconds: float) -> dict:
    """``tests.jobs.credit``'s body (a fenced read-modify-write), then the fence it wrote with."""
    result = jobs.credit.spec.func(name, credit_id, amount, seconds)
    held = current_lock()
    assert held is not None
    get_redis_connection("default").rpush("test:fences", f"{credit_id}:{held.fence}")
    return result


LOCK, KEY = "account:{name}", "credit:{credit_id}"


@locked_task(lock=LOCK, idempotency_key=KEY, ttl=2, backend="rq")
def credit_rq(name: str, credit_id: str, amount: int, seconds: float = 0.0) -> dict:
    return _credit(name, credit_id, amount, seconds)


@locked_task(lock=LOCK, idempotency_key=KEY, ttl=2)
def credit_inline(name: str, credit_id: str, amount: int, seconds: float = 0.0) -> dict:
    return _credit(name, credit_id, amount, seconds)


@locked_task(lock=LOCK, idempotency_key=KEY, ttl=2, backend="db")
def credit_db(name: str, credit_id: str, amount: int, seconds: float = 0.0) -> dict:
    return _credit(name, credit_id, amount, seconds)


@locked_task(lock=LOCK, ttl=2, on_conflict="skip")
def credit_or_skip(name: str, credit_id: str, amount: int) -> dict:
    return _credit(name, credit_id, amount, 0.0)


# As tests.jobs.paused_write / unfenced_write, as tasks (see there for atomic= and admission=).
@locked_task(
    lock="account:{name}", ttl=2, on_conflict="fail", backend="rq", admission=False, atomic=False
)
def paused_write(name: str, label: str, value: int) -> int:
    return int(jobs.paused_write.spec.func(name, label, value))


@locked_task(
    lock="account:{name}", ttl=2, on_conflict="fail", backend="rq", admission=False, atomic=False
)
def unfenced_write(name: str, label: str, value: int) -> int:
    return int(jobs.unfenced_write.spec.func(name, label, value))


@locked_task(lock="res:{resource_id}", ttl=2, backend="rq", atomic=False)
def hold(resource_id: int, label: str, seconds: float) -> str:
    """Holds its resource for ``seconds``; logs when (the FIFO test reads the order)."""
    client = get_redis_connection("default")
    started = time.time()
    client.rpush("test:started", label)
    client.set(f"test:pid:{label}", os.getpid())
    time.sleep(seconds)
    client.rpush("test:intervals", f"{label}:{started}:{time.time()}")
    return label


@locked_task(lock="res:{resource_id}", ttl=2, backend="rq", atomic=False, admission=False)
def hold_requeue_only(resource_id: int, label: str, seconds: float) -> str:
    """``hold`` on the requeue path alone: a busy resource requeues with backoff."""
    return str(hold.spec.func(resource_id, label, seconds))


def _seen(context, n: int) -> dict:  # type: ignore[no-untyped-def]
    """What a task with context saw: its result id, attempt count and lock."""
    held = current_lock()
    assert held is not None
    return {
        "id": context.task_result.id,
        "attempts": context.attempt,
        "lock": held.resource,
        "n": n,
    }


@locked_task(lock="res:{resource_id}", idempotency_key="ctx:{n}", takes_context=True)
def with_context(context, resource_id: int, n: int) -> dict:  # type: ignore[no-untyped-def]
    return _seen(context, n)


@locked_task(lock="res:{resource_id}", idempotency_key="ctx:{n}", takes_context=True, backend="rq")
def with_context_rq(context, resource_id: int, n: int) -> dict:  # type: ignore[no-untyped-def]
    return _seen(context, n)


@locked_task(lock="res:{resource_id}", idempotency_key="dd:{n}", dedupe=True, backend="rq")
def deduped(resource_id: int, n: int) -> int:
    return n


async def plain_async(n: int) -> int:
    """A plain RQ job (no task, no lock) written as ``async def``: RQ awaits it."""
    return n * 2


@locked_task(lock="scheduled:{n}", ttl=30, backend="rq", atomic=False)
def count_run(n: int) -> int:
    """A lock-only task that counts its runs (``test:runs``, field ``n``): tests/test_pauses.py
    enqueues it with ``run_after`` and checks that each ran once."""
    get_redis_connection("default").hincrby("test:runs", str(n), 1)
    return n


@locked_task(lock=LOCK, idempotency_key=KEY, ttl=2)
async def acredit_inline(name: str, credit_id: str, amount: int) -> dict:
    """An ``async def`` task: ``tests.jobs.acredit``'s body (the async ORM, fenced)."""
    return await jobs.acredit.spec.func(name, credit_id, amount)


@locked_task(lock=LOCK, idempotency_key=KEY, ttl=2, backend="rq")
async def acredit_rq(name: str, credit_id: str, amount: int) -> dict:
    return await jobs.acredit.spec.func(name, credit_id, amount)


@locked_task(lock=LOCK, idempotency_key=KEY, ttl=2, takes_context=True)
async def acredit_with_context(context: Any, name: str, credit_id: str, amount: int) -> dict:
    result = await jobs.acredit.spec.func(name, credit_id, amount)
    return {**result, "attempt": context.attempt}

"""Jobs for the three patterns of the design article.

- ``refund_order``: lock + idempotency + fencing. Two refunds of one order must not run at once
  (read-modify-write of ``refunded``); a refund delivered twice must be applied once; a holder
  paused past its TTL must not overwrite a newer holder's write.
- ``send_receipt``: idempotency only. Sending twice is the harm; running in parallel is not.
  The e-mail goes through the outbox (``send_after_commit``): it leaves after the job's
  commit, with its idempotency key handed to the mail provider (the demo's ``FakeProvider``,
  at ``JOBLOCK_DEMO_PROVIDER``), so a job killed before its commit has sent nothing.
- ``rebuild_tenant_cache``: lock only. Rebuilding twice is harmless; twice at once is not.

``tasks.goodwill_refund`` is a refund as a Django task (``@locked_task``), on the same lock.

Every committed effect appends its [start, end] interval to a Redis list per resource, so the
demo can prove no two committed critical sections overlapped.
"""

from __future__ import annotations

import os
import secrets
import time
from decimal import Decimal

from django.db import transaction
from django_redis import get_redis_connection

from django_joblock import current_lock, fenced_update, locked_job, send_after_commit
from django_joblock.jobs.decorator import LockedJob
from tests.procs.provider import post

from .models import Order, Receipt, Refund, Tenant

QUEUE = os.environ.get("JOBLOCK_DEMO_QUEUE", "demo")
WORK_SECONDS = float(os.environ.get("JOBLOCK_DEMO_WORK", "0.4"))


def _redis():  # type: ignore[no-untyped-def]
    return get_redis_connection("default")


def _record_interval(resource: str, started: float) -> None:
    def push() -> None:
        key = f"demo:intervals:{resource}"
        pipe = _redis().pipeline(transaction=False)
        pipe.rpush(key, f"{started}:{time.time()}")
        pipe.sadd("demo:keys", key)
        pipe.execute()

    transaction.on_commit(push)


def _mark_running(name: str) -> None:
    """Tell the demo which process runs what (it picks its fault targets from this list)."""
    pipe = _redis().pipeline(transaction=False)
    pipe.rpush("demo:started", f"{os.getpid()}|{name}|{time.time()}")
    pipe.ltrim("demo:started", -200, -1)
    pipe.execute()


@locked_job(QUEUE, lock="order:{order_id}", idempotency_key="refund:{refund_id}", ttl=2)
def refund_order(order_id: int, refund_id: str, amount: str) -> dict[str, str]:
    return apply_refund(order_id, refund_id, amount, running=f"refund {refund_id}")


def apply_refund(order_id: int, refund_id: str, amount: str, *, running: str) -> dict[str, str]:
    """A refund's effect, under the caller's ``order:{order_id}`` lock (a job's or a task's)."""
    started = time.time()
    _mark_running(running)
    order = Order.objects.get(pk=order_id)
    time.sleep(WORK_SECONDS)  # the payment provider's refund API
    held = current_lock()
    assert held is not None and held.fence is not None
    fenced_update(
        Order.objects.filter(pk=order_id),
        held.fence,
        refunded=order.refunded + Decimal(amount),
        refund_count=order.refund_count + 1,
    )
    Refund.objects.create(order_id=order_id, refund_id=refund_id, amount=Decimal(amount))
    _record_interval(f"order:{order_id}", started)
    return {"refund_id": refund_id, "amount": amount}


@locked_job(QUEUE, idempotency_key="receipt:{order_id}")
def send_receipt(order_id: int) -> dict[str, str]:
    _mark_running(f"receipt {order_id}")
    message_id = secrets.token_hex(8)
    time.sleep(WORK_SECONDS / 2)  # render the e-mail
    Receipt.objects.create(order_id=order_id, message_id=message_id)
    payload = {"order_id": order_id, "message_id": message_id}
    send_after_commit(deliver_receipt, payload, key=f"receipt:{order_id}")
    return {"message_id": message_id}


def deliver_receipt(payload: dict[str, object], *, idempotency_key: str) -> None:
    """The outbox's delivery: one call to the mail provider, with the key as its header."""
    post(os.environ["JOBLOCK_DEMO_PROVIDER"], payload, idempotency_key=idempotency_key)


@locked_job(QUEUE, lock="tenant:{tenant_id}", ttl=5)
def rebuild_tenant_cache(tenant_id: int) -> int:
    started = time.time()
    _mark_running(f"tenant {tenant_id}")
    with transaction.atomic():
        tenant = Tenant.objects.get(pk=tenant_id)
        time.sleep(WORK_SECONDS)  # recompute the tenant's cache
        Tenant.objects.filter(pk=tenant_id).update(cache_version=tenant.cache_version + 1)
        _record_interval(f"tenant:{tenant_id}", started)
    return tenant.cache_version + 1


ALL: list[LockedJob] = [refund_order, send_receipt, rebuild_tenant_cache]  # type: ignore[type-arg]

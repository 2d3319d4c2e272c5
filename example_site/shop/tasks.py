"""A Django task for the demo: a goodwill refund enqueued through Django's tasks framework
(``django.tasks``; the django-tasks backport on Django 5.2) instead of RQ directly.

``@locked_task`` gives it ``@locked_job``'s flow: the same ``order:{order_id}`` lock as
``jobs.refund_order`` (a task and a job never refund one order at once), a fenced write, and an
idempotency key that applies it once however often it is enqueued. ``TASKS`` (settings.py)
routes it to django-joblock's RQ backend, so the demo's workers run it beside the jobs, parked
in line behind a busy order like them.
"""

from __future__ import annotations

from django_joblock import locked_task

from .jobs import QUEUE, apply_refund


@locked_task(
    lock="order:{order_id}", idempotency_key="goodwill:{refund_id}", ttl=2, queue_name=QUEUE
)
def goodwill_refund(order_id: int, refund_id: str, amount: str) -> dict[str, str]:
    return apply_refund(order_id, refund_id, amount, running=f"goodwill {refund_id}")


ALL = [goodwill_refund]

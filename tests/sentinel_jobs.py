"""Jobs of the Sentinel worker test (tests/test_sentinel.py), importable by worker processes."""

from __future__ import annotations

import time

from django_joblock import current_lock, fenced_update, locked_job
from tests.testapp.models import Account


@locked_job("default", lock="sacct:{account}", idempotency_key="sentinel:{n}", ttl=4)
def add_one(account: str, n: int) -> int:
    """A racy read-sleep-write of ``account``'s balance, fenced: each ``n`` adds 1 once."""
    row = Account.objects.get(name=account)
    time.sleep(0.05)
    held = current_lock()
    assert held is not None and held.fence is not None
    fenced_update(Account.objects.filter(pk=row.pk), held.fence, balance=row.balance + 1)
    return n


@locked_job("default", lock="sacct:{account}", idempotency_key="sentinel-hold:{n}", ttl=4)
def hold(account: str, n: int, seconds: float) -> int:
    """Holds ``account``'s lock (and its admission slot) for ``seconds``; no write."""
    time.sleep(seconds)
    return n

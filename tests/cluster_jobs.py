"""Jobs of the Redis Cluster tests, importable by worker processes (tests/settings_cluster.py)."""

from __future__ import annotations

from django.db.models import F

from django_joblock import current_lock, fenced_update, locked_job
from tests.testapp.models import Account


@locked_job("default", lock="cl:{n}", ttl=5)
def fenced_effect(n: int) -> int:
    """Adds 1 to the balance of account ``cl-<n>`` with a fenced write; returns the fence."""
    held = current_lock()
    assert held is not None and held.fence is not None
    fenced_update(Account.objects.filter(name=f"cl-{n}"), held.fence, balance=F("balance") + 1)
    return held.fence

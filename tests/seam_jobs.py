"""Jobs of the deployment-seam tests, importable by worker processes."""

from __future__ import annotations

import decimal
import os
import time
import uuid
from datetime import UTC, datetime

from django_redis import get_redis_connection

from django_joblock import lock, locked_job
from tests.testapp.models import Account


def _wait_for_go(label: str, limit: float = 60.0) -> None:
    """Say which process runs ``label`` (on the lock Redis), then wait for the go flag."""
    client = get_redis_connection("default")
    client.set(f"test:pid:{label}", os.getpid())
    deadline = time.monotonic() + limit
    while not client.exists(f"test:go:{label}"):
        if time.monotonic() > deadline:
            raise TimeoutError(label)
        time.sleep(0.02)


@locked_job("default", lock="split:{n}", ttl=30)
def hold_until_told(n: int) -> int:
    """Holds its lock (TTL 30 s: no renewal within the first 10 s) until told to finish."""
    _wait_for_go(f"split{n}")
    return n


def hold_lock_in_a_plain_job(n: int) -> int:
    """A plain RQ job holding ``lock("split:<n>")`` itself: its worker does not know the lock
    (no ``@locked_job``), so a killed horse leaves it behind for the reaper."""
    with lock(f"split:{n}", ttl=30):
        _wait_for_go(f"split{n}")
    return n


@locked_job("default", lock="seam:{n}", ttl=2)
def write_then_wait(n: int) -> int:
    """A lock-only job: writes a row, then waits for its go flag (the test takes the lock)."""
    Account.objects.create(name=f"seam-{n}", balance=n)
    _wait_for_go(f"seam{n}")
    return n


@locked_job("default", idempotency_key="rich:{n}")
def rich_result(n: int) -> dict[str, object]:
    """Returns values plain JSON cannot hold."""
    return {
        "amount": decimal.Decimal("10.50"),
        "at": datetime(2024, 5, 1, 12, 0, tzinfo=UTC),
        "id": uuid.UUID(int=n),
    }


@locked_job("default", lock="plain:{n}")
def plain(n: int) -> int:
    return n


@locked_job("default", lock="plain:{n}", on_conflict="fail")
def plain_or_fail(n: int) -> int:
    return n


@locked_job("default", lock="plain:{n}", on_conflict="skip")
def plain_or_skip(n: int) -> int:
    return n


@locked_job("default", lock="plain:{n}", max_wait=1)
def plain_short_wait(n: int) -> int:
    return n


@locked_job("default", lock="plain:{n}", idempotency_key="plain:{n}")
def plain_once(n: int) -> int:
    return n


@locked_job("default", lock="plain:{n}")
def raises(n: int) -> int:
    raise RuntimeError(f"job {n} broke")


@locked_job("default", lock="brief:{n}", ttl=2)
def hold_briefly_renewed(n: int) -> int:
    """Holds a short-TTL lock (renewed every 2/3 s) until told to finish."""
    _wait_for_go(f"brief{n}")
    return n


@locked_job("default", lock="outage:{n}", ttl=5)
def run_after_outage(n: int, label: str) -> str:
    """Requeues on contention (the default): also when the lock's Redis does not answer."""
    Account.objects.create(name=label, balance=n)
    return label


@locked_job("default", lock="outage:{n}", ttl=5, on_conflict="fail")
def fail_on_outage(n: int, label: str) -> str:
    Account.objects.create(name=label, balance=n)
    return label

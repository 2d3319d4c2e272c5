"""Jobs for the admission, one-commit, unique and log tests (importable by the workers)."""

from __future__ import annotations

import os
import time

from django_redis import get_redis_connection
from redis.exceptions import RedisError
from rq import Queue

from django_joblock import current_lock, fenced_update, locked_job
from tests.testapp.models import Account


def _redis():  # type: ignore[no-untyped-def]
    return get_redis_connection("default")


def _log_interval(label: str, seconds: float) -> None:
    client = _redis()
    started = time.time()
    client.set(f"test:pid:{label}", os.getpid())
    time.sleep(seconds)
    client.rpush("test:intervals", f"{label}:{started}:{time.time()}")


def _wait_for(flag: str, limit: float = 60.0) -> None:
    """Wait for a flag the test sets; a Redis restart meanwhile is waited out, not fatal."""
    client = _redis()
    deadline = time.monotonic() + limit
    while True:
        try:
            if client.exists(flag):
                return
        except RedisError:
            pass  # the server is restarting
        if time.monotonic() > deadline:
            raise TimeoutError(flag)
        time.sleep(0.02)


HOT_TTL = 2  # the hot jobs' lock TTL (s)


@locked_job("default", lock="hot:{k}", ttl=HOT_TTL)
def hot(k: int, label: str, seconds: float) -> str:
    """A job on a hot resource (admission: the default)."""
    _log_interval(label, seconds)
    return label


@locked_job("default", lock="hot:{k}", ttl=HOT_TTL, atomic=False)
def hot_hold(k: int, label: str) -> str:
    """Holds the resource until ``test:go:<label>`` is set (or it is killed). No transaction:
    on SQLite an open one would hold every other job's writes back meanwhile."""
    client = _redis()
    started = time.time()
    client.set(f"test:pid:{label}", os.getpid())
    _wait_for(f"test:go:{label}")
    client.rpush("test:intervals", f"{label}:{started}:{time.time()}")
    return label


@locked_job("default", lock="hot:{k}", ttl=30, atomic=False)
def long_hold(k: int, label: str) -> str:
    """``hot_hold`` with a 30 s lock TTL: a killed holder's lock would outlive it for long."""
    return str(hot_hold.spec.func(k, label))


@locked_job("default", lock="hot:{k}", ttl=HOT_TTL, atomic=False)
def hot_sleep(k: int, label: str, seconds: float) -> str:
    """Holds the resource for ``seconds`` and touches Redis only as it starts: it can end while
    Redis is down."""
    _redis().set(f"test:pid:{label}", os.getpid())
    time.sleep(seconds)
    return label


@locked_job("default", lock="hot:{k}", ttl=HOT_TTL, admission=False)
def hot_outside(k: int, label: str, seconds: float) -> str:
    """The same resource without admission (a holder outside it, as on rq 2.x)."""
    _log_interval(label, seconds)
    return label


# -- one commit per job ----------------------------------------------------------------------
# heartbeat off and a long TTL: a lock taken away from under it (a failover that forgot it)
# goes unnoticed, so the run goes on to commit; admission off: the duplicate is not parked
# behind it. The only arbiter left between the two runs is the idempotency record.
@locked_job(
    "default",
    lock="account:{name}",
    idempotency_key="credit:{credit_id}",
    ttl=30,
    heartbeat=False,
    admission=False,
    job_timeout=25,
)
def credit_and_wait(name: str, credit_id: str, amount: int) -> dict[str, int]:
    _credit_and_wait(name, credit_id, amount)
    return {"credited": amount}


@locked_job(
    "default", lock="account:{name}", ttl=30, heartbeat=False, admission=False, job_timeout=25
)
def credit_and_wait_without_record(name: str, credit_id: str, amount: int) -> dict[str, int]:
    """Negative control: the same job without an idempotency key."""
    _credit_and_wait(name, credit_id, amount)
    return {"credited": amount}


def _credit_and_wait(name: str, credit_id: str, amount: int) -> None:
    """The effect is a ledger row per run (``ledger:<credit_id>:<pid>``): committed runs are
    counted by rows, whatever the isolation level does to a read-modify-write."""
    client = _redis()
    client.rpush(f"test:bodies:{credit_id}", os.getpid())
    Account.objects.create(name=f"ledger:{credit_id}:{os.getpid()}", balance=amount)
    _wait_for(f"test:go:{credit_id}")


@locked_job("default", lock="account:{name}", idempotency_key="credit:{credit_id}", ttl=5)
def credit_slowly(name: str, credit_id: str, amount: int) -> dict[str, int]:
    """Credits inside the job's transaction, then waits for its flag before committing."""
    _credit_and_wait(name, credit_id, amount)
    return {"credited": amount}


# A read-modify-write of one account by two logical jobs (two keys, or none), heartbeat off
# and a long TTL as above: the first keeps its transaction open (until its flag) after its
# lock was taken away; the second must not read the balance before the first commits, or its
# write (accepted: its fence is newer) would overwrite the first's credit.
@locked_job(
    "default",
    lock="account:{name}",
    idempotency_key="add:{credit_id}",
    ttl=30,
    heartbeat=False,
    admission=False,
    job_timeout=25,
)
def add_to_balance(name: str, credit_id: str, amount: int, wait: bool) -> int:
    return _add_to_balance(name, credit_id, amount, wait)


@locked_job(
    "default", lock="account:{name}", ttl=30, heartbeat=False, admission=False, job_timeout=25
)
def add_to_balance_without_key(name: str, credit_id: str, amount: int, wait: bool) -> int:
    """The same as a lock-only job (the job's transaction, no idempotency record)."""
    return _add_to_balance(name, credit_id, amount, wait)


def _add_to_balance(name: str, credit_id: str, amount: int, wait: bool) -> int:
    account = Account.objects.get(name=name)
    held = current_lock()
    assert held is not None and held.fence is not None
    value = account.balance + amount
    fenced_update(Account.objects.filter(pk=account.pk), held.fence, balance=value)
    _redis().rpush(f"test:bodies:{credit_id}", os.getpid())
    if wait:
        _wait_for(f"test:go:{credit_id}")
    return value


# -- dedupe=True -----------------------------------------------------------------------------
@locked_job("default", lock="hot:{k}", idempotency_key="send:{message}", ttl=2, dedupe=True)
def send_once(k: int, message: str) -> str:
    client = _redis()
    client.rpush("test:sent", message)
    _wait_for(f"test:go:{message}")
    return f"sent {message}"


# -- logs ------------------------------------------------------------------------------------
@locked_job("default", lock="hot:{k}", idempotency_key="log:{key}", ttl=2)
def logged(k: int, key: str) -> str:
    return key


@locked_job("default", lock="hot:{k}", ttl=2, admission=False, on_conflict="skip")
def logged_skip(k: int) -> None:
    return None


@locked_job("default", lock="hot:{k}", ttl=2, admission=False, max_wait=1)
def logged_requeue(k: int) -> None:
    return None


@locked_job("default", lock="hot:{k}", ttl=2)
def logged_failure(k: int) -> None:
    raise ValueError("the body failed")


# -- plain RQ (negative control of the FIFO test) ---------------------------------------------
def plain_hold(label: str) -> str:
    client = _redis()
    client.set(f"test:pid:{label}", os.getpid())
    _wait_for(f"test:go:{label}")
    return label


def plain_sleep(label: str, seconds: float) -> str:
    _redis().set(f"test:pid:{label}", os.getpid())
    time.sleep(seconds)
    return label


def plain_interval(label: str, seconds: float) -> str:
    _log_interval(label, seconds)
    return label


# -- synchronous queues ------------------------------------------------------------------------
SYNC = Queue("sync", connection=get_redis_connection("default"), is_async=False)


@locked_job(SYNC, lock="res:{k}", ttl=2)
def sync_work(k: int) -> str:
    return "ran"


@locked_job(SYNC, lock="res:{k}", ttl=2, on_conflict="skip")
def sync_skip(k: int) -> str:
    return "ran"


@locked_job("default", lock="res:{k}", ttl=2)
def django_rq_work(k: int) -> str:
    """On django-rq's "default" queue (a test makes it ``ASYNC: False``)."""
    return "ran"


PAUSE_TTL = 4  # the lock TTL of append_in_order (s)


@locked_job("default", lock="account:{name}", ttl=PAUSE_TTL)
def append_in_order(name: str, label: str, hold: bool) -> str:
    """Adds 1 to the account's balance in the job's transaction; once it commits, appends
    ``label:<time>`` to ``test:commits``. With ``hold`` it then waits inside its transaction
    (a test stops its worker there)."""
    from django.db import transaction
    from django.db.models import F

    Account.objects.filter(name=name).update(balance=F("balance") + 1)
    transaction.on_commit(lambda: _redis().rpush("test:commits", f"{label}:{time.time()}"))
    _redis().set(f"test:pid:{label}", os.getpid())
    if hold:
        _wait_for(f"test:go:{label}", limit=600)
    return label


QUOTA_LIMIT = 3  # the limited jobs' concurrency: at most this many run per resource


@locked_job("default", lock="quota:{k}", ttl=HOT_TTL, concurrency=QUOTA_LIMIT)
def limited(k: int, label: str, seconds: float) -> str:
    """A job on a resource that allows three runs at once."""
    _log_interval(label, seconds)
    return label


@locked_job("default", lock="quota:{k}", ttl=HOT_TTL, concurrency=QUOTA_LIMIT, atomic=False)
def limited_hold(k: int, label: str) -> str:
    """``hot_hold`` on the limited resource: holds a slot until ``test:go:<label>``."""
    return str(hot_hold.spec.func(k, label))


@locked_job("default", lock="quota:{k}", ttl=HOT_TTL, concurrency=QUOTA_LIMIT)
def limited_write(k: int, label: str) -> str:
    """Waits for its go flag (a test may pause it past its TTL meanwhile), then writes a row in
    the job's transaction, which commits only while the job still holds its slot."""
    _redis().set(f"test:pid:{label}", os.getpid())
    _wait_for(f"test:go:{label}")
    Account.objects.create(name=label, balance=1)
    return label

"""Jobs the worker-process tests enqueue (importable by the workers)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from django.db import connection as db_connection
from django.db import transaction
from django_redis import get_redis_connection

from django_joblock import (
    afenced_update,
    current_lock,
    fenced_update,
    locked_job,
    send_after_commit,
)
from tests.procs.provider import post
from tests.testapp.models import Account


def _redis():  # type: ignore[no-untyped-def]
    return get_redis_connection("default")


def _log_interval(label: str, seconds: float) -> None:
    client = _redis()
    started = time.time()
    client.rpush("test:started", f"{label}:{os.getpid()}")
    client.set(f"test:pid:{label}", os.getpid())
    time.sleep(seconds)
    client.rpush("test:intervals", f"{label}:{started}:{time.time()}")


@locked_job("default", lock="res:{resource_id}", ttl=2)
def hold_resource(resource_id: int, label: str, seconds: float) -> str:
    _log_interval(label, seconds)
    return label


@locked_job("default", lock="res:{resource_id}", ttl=30)
def hold_steadily(resource_id: int, label: str, seconds: float) -> str:
    """:func:`hold_resource` with a 30 s lock: on a busy machine no late renewal loses it."""
    _log_interval(label, seconds)
    return label


@locked_job("default", lock="res:{resource_id}", ttl=2)
def hold_past_timeout(resource_id: int, label: str, seconds: float) -> str:
    """Holds on past its ``job_timeout``: RQ's timeout (SIGALRM in the horse) cannot reach it,
    as it cannot reach a job stuck in a C call."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    _log_interval(label, seconds)
    return label


@locked_job("default", lock="res:{resource_id}", ttl=2, atomic=False)
def hold_outside_db(resource_id: int, label: str, seconds: float) -> str:
    """No transaction around the body: on SQLite, long holders do not queue on its write lock."""
    _log_interval(label, seconds)
    return label


@locked_job("default", lock="res:{resource_id}", ttl=2, admission=False)
def hold_requeue_only(resource_id: int, label: str, seconds: float) -> str:
    """The requeue path alone: a busy resource requeues with backoff (rq 2.x behaviour)."""
    _log_interval(label, seconds)
    return label


@locked_job("default", lock="res:{resource_id}", ttl=2, on_conflict="skip")
def hold_or_skip(resource_id: int, label: str, seconds: float) -> str:
    _log_interval(label, seconds)
    return label


@locked_job("default", lock="res:{resource_id}", ttl=2, on_conflict="fail")
def hold_or_fail(resource_id: int, label: str, seconds: float) -> str:
    _log_interval(label, seconds)
    return label


@locked_job("default", lock="res:{resource_id}", ttl=2, max_wait=3)
def hold_with_short_wait(resource_id: int, label: str, seconds: float) -> str:
    _log_interval(label, seconds)
    return label


@locked_job("default", lock="account:{name}", idempotency_key="credit:{credit_id}", ttl=2)
def credit(name: str, credit_id: str, amount: int, seconds: float = 0.0) -> dict:
    """Read-modify-write of an account balance, fenced, inside the job's transaction."""
    client = _redis()
    client.set(f"test:pid:{credit_id}", os.getpid())
    client.rpush("test:started", f"{credit_id}:{os.getpid()}")
    account = Account.objects.get(name=name)
    time.sleep(seconds)
    held = current_lock()
    assert held is not None and held.fence is not None
    fenced_update(
        Account.objects.filter(pk=account.pk), held.fence, balance=account.balance + amount
    )
    client.incr(f"test:effects:{credit_id}")
    return {"credited": amount}


def _wait_for_flag(label: str, limit: float = 60.0) -> None:
    client = _redis()
    client.set(f"test:pid:{label}", os.getpid())
    deadline = time.monotonic() + limit
    while not client.exists(f"test:go:{label}"):
        if time.monotonic() > deadline:
            raise TimeoutError(label)
        time.sleep(0.02)


# atomic=False: these two show what the fence alone does for a job without the job
# transaction (which would roll a stale write back anyway, and on SQLite would hold the database
# lock while the test pauses the horse). admission=False: the newer job must take the expired
# lock while the paused one still holds its admission slot (with admission it would wait for
# the paused job to end, and there would be no stale holder to fence).
@locked_job(
    "default", lock="account:{name}", ttl=2, on_conflict="fail", atomic=False, admission=False
)
def paused_write(name: str, label: str, value: int) -> int:
    """Waits for its go flag (a test pauses it meanwhile), then writes through the fence."""
    _wait_for_flag(label)
    held = current_lock()
    assert held is not None and held.fence is not None
    fenced_update(Account.objects.filter(name=name), held.fence, balance=value)
    _redis().rpush("test:written", label)
    return value


@locked_job(
    "default", lock="account:{name}", ttl=2, on_conflict="fail", atomic=False, admission=False
)
def unfenced_write(name: str, label: str, value: int) -> int:
    """The same without fencing: a negative control."""
    _wait_for_flag(label)
    Account.objects.filter(name=name).update(balance=value)
    _redis().rpush("test:written", label)
    return value


@locked_job("default", lock="account:{name}", idempotency_key="acredit:{credit_id}", ttl=2)
async def acredit(name: str, credit_id: str, amount: int, seconds: float = 0.0) -> dict:
    """``credit``'s async twin: Django's async ORM and ``afenced_update`` inside the job's
    transaction; ``test:after:<credit_id>`` says the body ran past its sleep."""
    account = await Account.objects.aget(name=name)
    await asyncio.sleep(seconds)
    _redis().set(f"test:after:{credit_id}", os.getpid())
    held = current_lock()
    assert held is not None and held.fence is not None
    balance = account.balance + amount
    await afenced_update(Account.objects.filter(pk=account.pk), held.fence, balance=balance)
    _redis().incr(f"test:effects:{credit_id}")
    return {"credited": amount, "fence": held.fence}


@locked_job("default", lock="account:{name}", idempotency_key="credit:{credit_id}", ttl=2)
def credit_then_hang(name: str, credit_id: str, amount: int) -> dict:
    """Writes the credit inside the job's transaction, then hangs until killed (first run) or
    returns (later runs, when test:go:<credit_id> is set)."""
    account = Account.objects.get(name=name)
    held = current_lock()
    assert held is not None and held.fence is not None
    fenced_update(
        Account.objects.filter(pk=account.pk), held.fence, balance=account.balance + amount
    )
    _redis().incr(f"test:runs:{credit_id}")
    _wait_for_flag(credit_id)
    return {"credited": amount}


@locked_job(
    "default", lock="dupres:{resource_id}", idempotency_key="dup:{n}", ttl=2, admission=False
)
def keyed_hold(resource_id: int, n: int, seconds: float) -> int:
    """Holds its resource for ``seconds`` under idempotency key ``dup:{n}`` (requeue path)."""
    time.sleep(seconds)
    _redis().rpush("test:keyed", n)
    return n


def mail_handler(payload: dict, *, idempotency_key: str) -> None:
    """The outbox's delivery of a test e-mail: the provider gets the key as its header."""
    post(_redis().get("test:provider").decode(), payload, idempotency_key=idempotency_key)


def mail_handler_then_hang(payload: dict, *, idempotency_key: str) -> None:
    """Delivers, then hangs until killed (first delivery) or its go flag is set: a crash
    between the provider's answer and the message's update."""
    mail_handler(payload, idempotency_key=idempotency_key)
    _wait_for_flag(f"deliver:{idempotency_key}")


def mail_handler_killing_its_process(payload: dict, *, idempotency_key: str) -> None:
    """A delivery the process does not survive (the OOM killer, a segfault in a C library)."""
    os.kill(os.getpid(), signal.SIGKILL)


@locked_job("default", lock="mail:{order}", idempotency_key="mail:{order}", ttl=2)
def mail_via_outbox(order: int, hang_in: str = "job") -> str:
    """Records the e-mail in the outbox, then hangs between that and its commit (first run)."""
    handler = mail_handler_then_hang if hang_in == "delivery" else mail_handler
    send_after_commit(handler, {"order": order}, key=f"mail:{order}")
    _redis().incr(f"test:runs:mail:{order}")
    if hang_in == "job":
        _wait_for_flag(f"mail:{order}")
    return "recorded"


@locked_job("default", lock="mail:{order}", idempotency_key="directmail:{order}", ttl=2)
def mail_direct(order: int) -> str:
    """The negative control: sends inside the job (no outbox, no key), then hangs."""
    post(_redis().get("test:provider").decode(), {"order": order})
    _redis().incr(f"test:runs:directmail:{order}")
    _wait_for_flag(f"directmail:{order}")
    return "sent"


@locked_job("default", lock="young:{resource_id}", ttl=10)
def hold_young(resource_id: int, label: str, seconds: float) -> str:
    """A lock with a TTL long enough to look at it after its holder was killed."""
    _log_interval(label, seconds)
    return label


class Options:
    """A plain object as a job argument: its default repr holds a memory address."""

    def __init__(self, value: int) -> None:
        self.value = value


@locked_job("default", lock="tags:{order}", idempotency_key="tags:{order}", ttl=5)
def tag_order(order: int, tags: set[str], opts: Options) -> list[str]:
    """Arguments JSON cannot encode (a set, an object): a second delivery must replay."""
    _redis().incr(f"test:effects:tags:{order}")
    return [*sorted(tags), str(opts.value)]


@locked_job("default", lock="meta:{n}")
def writes_meta_elsewhere(n: int, stored: str) -> None:
    """Meanwhile another process writes this job's meta: readable, or bytes nobody can read."""
    from rq import get_current_job
    from rq.job import Job

    job = get_current_job()
    assert job is not None
    if stored == "unreadable":
        _redis().hset(job.key, "meta", b"\x80not a pickle")
        return
    other = Job.fetch(job.id, connection=_redis())
    other.meta["progress"] = "written by another process"
    other.save_meta()


@locked_job("default", lock="account:{name}", on_commit=False, atomic=False)
def read_account_at_once(name: str) -> int:
    """Enqueued at once even inside a transaction (the negative control of enqueue on commit);
    no transaction of its own, whose ``BEGIN IMMEDIATE`` on SQLite would wait for the commit."""
    return Account.objects.get(name=name).balance


def slow_handler(payload: dict, *, idempotency_key: str) -> None:
    """A delivery that takes a second (a slow provider), its span logged as ``sent:<label>``."""
    _log_interval(f"sent:{payload['label']}", 1.0)


@locked_job("default", lock="res:{resource_id}", ttl=5)
def sends_slowly(resource_id: int, label: str) -> str:
    """A short job on a shared resource whose side effect is a slow outbox delivery."""
    _log_interval(label, 0.05)
    send_after_commit(slow_handler, {"label": label}, key=f"slow:{label}")
    return label


@locked_job("default", lock="account:{name}")
def read_balance(name: str) -> int:
    """A lock-only job whose body reads one row (in the job's transaction)."""
    return Account.objects.get(name=name).balance


@locked_job("default", lock="episode:{k}", ttl=5, max_wait=2, admission=False, atomic=False)
def fails_once(k: int) -> int:
    """Raises on its first run (RQ's ``Retry`` brings it back), then returns its run count."""
    runs = int(_redis().incr(f"test:fails_once:{k}"))
    if runs == 1:
        raise RuntimeError("the first run fails")
    return runs


@locked_job("default", lock="cost:{n}")
def report_connection(n: int, query: bool) -> bool:
    """Lock-only, in the job's transaction: was a database connection open at the body's end
    (after one query when ``query``)?"""
    if query:
        Account.objects.filter(name=f"cost:{n}").exists()
    return db_connection.connection is not None


@locked_job("default", lock="account:{name}", ttl=5)
def add_in_own_transaction(name: str, amount: int) -> int:
    """Lock-only: the body's first database use is its own transaction (a read-modify-write)."""
    with transaction.atomic():
        account = Account.objects.get(name=name)
        Account.objects.filter(pk=account.pk).update(balance=account.balance + amount)
    return account.balance + amount


def plain_noop(n: int) -> int:
    """A plain RQ job doing nothing: what a job costs RQ itself (tests/test_job_cost.py)."""
    return n


@locked_job("default", lock="cost:{n}", admission=False)
def locked_noop(n: int) -> int:
    """The same under a lock of its own, no admission: what the lock adds."""
    return n


def plain_nap(n: int, seconds: float) -> int:
    """A plain RQ job that sleeps ``seconds`` (longer than a metrics flush interval)."""
    time.sleep(seconds)
    return n


@locked_job("default", lock="cost:{n}", admission=False)
def locked_nap(n: int, seconds: float) -> int:
    """The same under a lock of its own: its metrics still wait for its release."""
    time.sleep(seconds)
    return n


@locked_job("default", lock="account:{name}")
def add_to_locked_row(name: str, amount: int) -> int:
    """Lock-only: the body's first query locks its row (``select_for_update()``, which Django
    allows only inside a transaction: the job's)."""
    account = Account.objects.select_for_update().get(name=name)
    account.balance += amount
    account.save(update_fields=["balance"])
    return account.balance


@locked_job("default", lock="account:{name}", ttl=2, job_timeout=1)
async def aovertime(name: str, tag: str) -> None:
    """Awaits past its 1 s ``job_timeout``, then marks ``test:after:<tag>``: it must never get
    there (the timeout ends the job, and its body with it)."""
    await asyncio.sleep(3)
    _redis().set(f"test:after:{tag}", os.getpid())

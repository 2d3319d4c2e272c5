"""``@locked_job`` on an ``async def``: the body is awaited inside the job's flow (lock,
heartbeat, claim, transaction, record), inline and on real RQ workers of both classes."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Any

import pytest
from rq.job import JobStatus

from django_joblock import LockLost
from tests import jobs
from tests.harness import expire_now
from tests.testapp.models import Account
from tests.workers import Workers, wait_status

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_async_job_inline_runs_once_under_its_lock_and_replays_a_duplicate(rconn):
    Account.objects.create(name="a", balance=5)
    first = jobs.acredit("a", "C-1", 10)
    again = jobs.acredit("a", "C-1", 10)  # the same key: replayed, not run
    assert first["credited"] == 10 and first["fence"] > 0
    assert again == first
    assert Account.objects.get(name="a").balance == 15
    assert int(rconn.get("test:effects:C-1")) == 1
    assert not rconn.keys("joblock:*:lock"), "released"


def test_an_async_job_whose_lock_is_lost_is_cancelled_and_rolled_back(rconn):
    """The heartbeat finds the lock gone while the body sleeps: the body's task is cancelled
    (it never gets past its sleep), the job fails with LockLost and writes nothing."""
    Account.objects.create(name="a", balance=5)
    threading.Timer(0.5, expire_now, args=(rconn, "joblock:{account:a}:lock")).start()
    with pytest.raises(LockLost, match="aborted"):
        jobs.acredit("a", "C-2", 10, seconds=5)
    assert rconn.get("test:after:C-2") is None, "the body was cancelled in its sleep"
    assert Account.objects.get(name="a").balance == 5


def test_with_the_abort_off_the_lost_async_job_runs_on_and_still_commits_nothing(rconn, settings):
    """Negative control of the test above: without the abort the body is not cancelled (it
    runs past its sleep); the loss still fails the job at its record, rolled back."""
    settings.JOBLOCK = {**settings.JOBLOCK, "ON_LOCK_LOST": "flag"}
    Account.objects.create(name="a", balance=5)
    threading.Timer(0.5, expire_now, args=(rconn, "joblock:{account:a}:lock")).start()
    with pytest.raises(LockLost):
        jobs.acredit("a", "C-3", 10, seconds=2)
    assert rconn.get("test:after:C-3") is not None, "the body ran on"
    assert Account.objects.get(name="a").balance == 5


@pytest.mark.slow
@pytest.mark.parametrize("simple", [False, True], ids=["Worker", "SimpleWorker"])
def test_an_async_job_enqueued_from_async_code_runs_on_real_workers_once(settings, rconn, simple):
    Account.objects.create(name="a", balance=0)
    crew = Workers(settings.JOBLOCK)
    try:
        crew.start(simple=simple)

        async def enqueue_twice() -> list[Any]:  # from async code; a duplicate delivery
            return [await jobs.acredit.adelay("a", "C-4", 10) for _ in range(2)]

        delivered = asyncio.run(enqueue_twice())
        for job in delivered:
            assert wait_status(job, {JobStatus.FINISHED, JobStatus.FAILED}, 60) is (
                JobStatus.FINISHED
            ), crew.logs()
        outcomes = sorted(job.get_meta(refresh=True)["joblock"]["outcome"] for job in delivered)
    finally:
        crew.stop()
    assert outcomes == ["ran", "replayed"]
    assert Account.objects.get(name="a").balance == 10
    assert int(rconn.get("test:effects:C-4")) == 1


class Interrupted(Exception):
    """What RQ's job timeout raises in the job's thread (from a SIGALRM handler)."""


def test_an_async_job_whose_thread_is_interrupted_does_not_run_on_without_its_lock(rconn):
    """Review bug: RQ's job timeout (SIGALRM in the job's thread) interrupted the thread's
    wait for the body, the flow rolled back and released the lock, and the body ran on in its
    loop's thread: past its sleep, writing its effects outside the lock."""
    Account.objects.create(name="a", balance=5)

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(Interrupted):
            jobs.acredit("a", "C-5", 10, seconds=1.5)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not rconn.keys("joblock:*:lock"), "released"
    time.sleep(2)  # past the body's sleep
    assert rconn.get("test:after:C-5") is None, "the body ended with its job"
    assert Account.objects.get(name="a").balance == 5


@pytest.mark.slow
def test_an_async_job_past_its_timeout_on_a_simple_worker_ends_with_its_body(settings, rconn):
    """The same on a real SimpleWorker (the job runs in the worker process, which lives on):
    the job fails with its timeout and its body never gets past its sleep."""
    crew = Workers(settings.JOBLOCK)
    try:
        crew.start(simple=True)
        job = jobs.aovertime.delay("a", "T-1")
        status = wait_status(job, {JobStatus.FINISHED, JobStatus.FAILED}, 60)
        assert status is JobStatus.FAILED, crew.logs()
        time.sleep(3.5)  # past the body's sleep, the worker still running
        after = rconn.get("test:after:T-1")
    finally:
        crew.stop()
    assert after is None, "the body ended with its job"

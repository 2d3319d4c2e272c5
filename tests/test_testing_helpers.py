"""``django_joblock.testing``: in-process job runs with the real flow, and the held-lock check."""

from __future__ import annotations

import signal

import pytest
from rq import Worker
from rq.job import JobStatus

from django_joblock import lock
from django_joblock.testing import assert_no_locks_held, no_locks_held, run_jobs
from tests import jobs
from tests.harness import wait_for
from tests.testapp.models import Account

pytestmark = pytest.mark.django_db(transaction=True)


def test_run_jobs_applies_the_real_flow_and_replays_a_duplicate(rconn):
    Account.objects.create(name="acct", balance=0)
    first = jobs.credit.delay("acct", "T-1", 10)
    again = jobs.credit.delay("acct", "T-1", 10)  # a duplicate delivery
    with no_locks_held():
        run = run_jobs("default")
    assert run.statuses() == {first.id: JobStatus.FINISHED, again.id: JobStatus.FINISHED}
    assert run.outcomes() == {first.id: "ran", again.id: "replayed"}
    assert Account.objects.get(name="acct").balance == 10
    assert int(rconn.get("test:effects:T-1")) == 1


@pytest.mark.slow
def test_twenty_run_jobs_calls_in_a_row_each_end_within_5_seconds(rconn):
    """Regression: run_jobs()'s worker lacked the workers' bound on RQ's unsubscribe, and some
    calls stalled 60 s: RQ's pubsub thread, woken by the UNSUBSCRIBE reply before redis-py 8's
    ``stop()`` cleared its flag, waits 60 s for the next message. The race is lost most often
    on a busy machine (the old worker stalled within 6 calls with the cores busy): each call
    now ends promptly, a stall being 60 s."""
    import time

    from tests.procs.load import BusyCores

    took = []
    with BusyCores():
        for n in range(20):
            jobs.credit.delay("acct", f"R-{n}", 1)
            started = time.monotonic()
            run = run_jobs("default")
            took.append(time.monotonic() - started)
            assert len(run.jobs) == 1
    assert max(took) < 5, [f"{seconds:.2f}" for seconds in took]


def test_a_contended_job_is_requeued_by_rq_and_run_once_the_lock_is_free(rconn):
    outside = lock("res:1", ttl=30)
    assert outside.acquire()
    job = jobs.hold_resource.delay(1, "waits", 0.0)
    run = run_jobs("default", max_rounds=3)
    assert run.rounds == 3 and run.fast_forwarded >= 2, "requeued by RQ, fast-forwarded"
    assert [waiting.id for waiting in run.pending] == [job.id]
    assert run.outcomes()[job.id] == "requeued"
    assert job.get_meta(refresh=True)["joblock"]["requeues"] >= 3
    assert not rconn.lrange("test:started", 0, -1), "never ran while the lock was held"
    assert outside.release()
    run = run_jobs("default")
    assert run.statuses() == {job.id: JobStatus.FINISHED}
    assert run.outcomes() == {job.id: "ran"}
    assert run.pending == []


def test_a_lock_left_held_is_named():
    with pytest.raises(AssertionError, match=r"1 lock\(s\) left held: forgotten:1 \(owner "):
        with no_locks_held():
            held = lock("forgotten:1", ttl=30)
            held.acquire()
    held.release()
    assert_no_locks_held()


def test_max_rounds_is_checked():
    with pytest.raises(ValueError, match="max_rounds must be an int >= 1"):
        run_jobs("default", max_rounds=0)


@pytest.mark.parametrize("stored", ["readable", "unreadable"])
def test_a_jobs_end_writes_only_our_key_of_its_meta(stored, rconn):
    """The outcome used to be written as the worker's whole in-memory ``job.meta``: meta that
    another process wrote during the run was lost, unreadable meta overwritten."""
    job = jobs.writes_meta_elsewhere.delay(1, stored)
    run = run_jobs("default")
    assert run.statuses() == {job.id: JobStatus.FINISHED}
    if stored == "unreadable":
        assert rconn.hget(job.key, "meta") == b"\x80not a pickle", "left to its writer"
        return
    meta = job.get_meta(refresh=True)
    assert meta["progress"] == "written by another process"
    assert meta["joblock"]["outcome"] == "ran"


@pytest.mark.slow
def test_run_jobs_refuses_a_queue_that_live_workers_consume(settings, rconn):
    """A development worker left running on the tests' queues took their jobs and ran them
    against the development database. run_jobs() names the workers and runs nothing."""
    from tests.workers import Workers

    crew = Workers(settings.JOBLOCK)
    try:
        worker = crew.start("default")
        # Idle: past its start-up (RQ installs its SIGTERM handler after registering).
        idle = lambda: [w.get_state() for w in Worker.all(connection=rconn)] == ["idle"]  # noqa: E731
        assert wait_for(idle, 30), crew.logs()
        with pytest.raises(RuntimeError, match=r"queue .default. has live workers on its Redis"):
            run_jobs("default")
        worker.send_signal(signal.SIGTERM)  # stopped as a developer would: it unregisters
        worker.wait(30)
    finally:
        crew.stop()
    assert not Worker.all(connection=rconn)
    job = jobs.hold_resource.delay(9, "alone", 0.0)
    assert run_jobs("default").statuses() == {job.id: JobStatus.FINISHED}


def test_run_jobs_runs_a_locked_task(rconn):
    """``run_jobs()`` ran RQ's job class: a ``@locked_task`` on the RQ backend failed in it."""
    from tests import task_jobs

    Account.objects.create(name="acct")
    result = task_jobs.credit_rq.enqueue("acct", "T-1", 5)
    run_jobs()
    assert Account.objects.get(name="acct").balance == 5
    refreshed = task_jobs.credit_rq.get_result(result.id)
    assert refreshed.status == "SUCCESSFUL", refreshed.errors
    assert refreshed.return_value == {"credited": 5}


def test_async_code_enqueues_with_adelay_and_aenqueue_and_the_duplicate_replays(rconn):
    import asyncio

    Account.objects.create(name="acct", balance=0)

    async def enqueue_from_async_code() -> list[object]:
        first = await jobs.credit.adelay("acct", "A-1", 10)
        again = await jobs.credit.aenqueue("acct", "A-1", 10, job_timeout=60)  # a duplicate
        return [first, again]

    first, again = asyncio.run(enqueue_from_async_code())
    assert again.timeout == 60, "aenqueue takes RQ's options as enqueue does"
    run = run_jobs("default")
    assert run.outcomes() == {first.id: "ran", again.id: "replayed"}
    assert Account.objects.get(name="acct").balance == 10

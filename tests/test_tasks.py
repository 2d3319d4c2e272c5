"""``@locked_task``: Django tasks with the safe flow, on the immediate backend (inline), the
database backend (django-tasks-db's worker, in this process) and the RQ backend (real worker
processes; slow)."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.utils import timezone

from django_joblock import (
    IdempotencyKeyMismatch,
    IdempotencyRecord,
    InvalidResource,
    LockNotAcquired,
    lock,
    lock_info,
    locked_job,
    locked_task,
)
from django_joblock.jobs import admission
from django_joblock.jobs.decorator import registry
from django_joblock.jobs.queues import get_queue
from django_joblock.jobs.rq_tasks import Job as TaskJob
from django_joblock.jobs.task import LockedTask
from tests import jobs, task_jobs
from tests.harness import wait_for
from tests.testapp.models import Account
from tests.workers import DONE, Workers, intervals, pid_of, wait_status

pytestmark = pytest.mark.django_db(transaction=True)

try:
    from django.tasks import TaskResultStatus
except ImportError:  # Django 5.2
    from django_tasks import TaskResultStatus  # type: ignore[no-redef]

OK, FAILED, READY = TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED, TaskResultStatus.READY


def _account(balance: int = 0) -> Account:
    return Account.objects.create(name="acct", balance=balance)


def _refreshed(result, timeout: float = 40, crew: Workers | None = None):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        result.refresh()
        if result.is_finished:
            return result
        if time.monotonic() > deadline:
            logs = crew.logs() if crew is not None else ""
            raise AssertionError(f"task {result.id} still {result.status}\n{logs}")
        time.sleep(0.05)


# -- decoration and enqueue: mistakes fail in the caller ---------------------------------


def test_locked_task_is_a_django_task_with_the_spec():
    task = task_jobs.credit_inline
    assert isinstance(task, LockedTask)
    assert task.module_path == task.spec.name == "tests.task_jobs.credit_inline"
    assert task.using(priority=1).spec is task.spec  # using() keeps the class


def test_bad_options_and_arguments_fail_in_the_caller(rconn):
    with pytest.raises(ValueError, match="on_conflict must be one of"):
        locked_task(lock="x:{a}", on_conflict="wait")
    with pytest.raises(ValueError, match="job_timout is not an option of RQ's enqueue"):
        locked_task(lock="res:{resource_id}", job_timout=5)(task_jobs.hold.spec.func)
    with pytest.raises(ValueError, match=r"transaction\.on_commit"):
        locked_task(lock="res:{resource_id}", on_commit=True)
    with pytest.raises(TypeError, match="takes keywords"):
        locked_task(task_jobs.hold.spec.func)
    with pytest.raises(TypeError, match="in place of @task"):
        locked_task(lock="x:{name}")(task_jobs.credit_inline)
    queued = rconn.llen("rq:queue:default")
    with pytest.raises(TypeError, match="missing a required argument"):
        task_jobs.credit_rq.enqueue("acct")
    with pytest.raises(InvalidResource, match="it contains ' '"):
        task_jobs.credit_inline.enqueue("a b", "C-1", 1)
    assert rconn.llen("rq:queue:default") == queued, "nothing enqueued"
    assert not Account.objects.exists()


# -- the immediate backend: runs inline, real lock and idempotency -----------------------


def test_inline_task_applies_once_and_replays(rconn):
    _account()
    first = task_jobs.credit_inline.enqueue("acct", "C-1", 10)
    second = task_jobs.credit_inline.enqueue("acct", "C-1", 10)
    assert (first.status, second.status) == (OK, OK), (first.errors, second.errors)
    assert first.return_value == second.return_value == {"credited": 10}
    assert Account.objects.get().balance == 10
    assert int(rconn.get("test:effects:C-1")) == 1, "negative control: the body ran once"
    record = IdempotencyRecord.objects.get(key="credit:C-1")
    assert (record.status, record.attempts) == ("succeeded", 1)


def test_inline_task_on_a_busy_resource_fails_visibly_after_acquire_wait(settings, rconn):
    settings.JOBLOCK = {"ACQUIRE_WAIT": 0.3}
    _account()
    with lock("account:acct", ttl=10):
        busy = task_jobs.credit_inline.enqueue("acct", "C-2", 5)
        skipped = task_jobs.credit_or_skip.enqueue("acct", "C-3", 5)
    assert busy.status == FAILED
    assert busy.errors[0].exception_class is LockNotAcquired, busy.errors
    assert skipped.status == OK and skipped.return_value is None
    assert Account.objects.get().balance == 0 and not rconn.exists("test:effects:C-2")
    # Nothing was recorded for the key: enqueued again once the resource is free, it runs.
    again = task_jobs.credit_inline.enqueue("acct", "C-2", 5)
    assert again.status == OK and Account.objects.get().balance == 5


# -- the database backend: django-tasks-db's worker -------------------------------------


def _db_worker() -> None:
    call_command("db_worker", "--batch", "--backend=db", "--interval=0", verbosity=0)


def test_db_backend_task_applies_once(rconn):
    _account()
    results = [task_jobs.credit_db.enqueue("acct", "D-1", 7) for _ in range(3)]
    assert len({result.id for result in results}) == 3
    _db_worker()
    for result in results:
        result.refresh()
        assert result.status == OK, result.errors
        assert result.return_value == {"credited": 7}
    assert Account.objects.get().balance == 7
    assert int(rconn.get("test:effects:D-1")) == 1


def test_db_backend_task_on_a_busy_resource_fails_visibly(settings, rconn):
    settings.JOBLOCK = {"ACQUIRE_WAIT": 0.3}
    _account()
    result = task_jobs.credit_db.enqueue("acct", "D-2", 7)
    with lock("account:acct", ttl=10):
        _db_worker()
    result.refresh()
    assert result.status == FAILED
    assert result.errors[0].exception_class is LockNotAcquired, result.errors
    assert Account.objects.get().balance == 0
    control = task_jobs.credit_db.enqueue("acct", "D-2", 7)  # negative control: free, it runs
    _db_worker()
    control.refresh()
    assert control.status == OK and Account.objects.get().balance == 7


# -- the RQ backend: real worker processes ------------------------------------------------


@pytest.fixture
def workers(settings) -> Iterator[Workers]:  # type: ignore[no-untyped-def]
    settings.JOBLOCK = {"REQUEUE_BACKOFF": {"base": 1, "factor": 2, "max": 8}}
    crew = Workers(settings.JOBLOCK)
    yield crew
    crew.stop()


@pytest.mark.slow
def test_rq_duplicate_deliveries_apply_once(workers, rconn):
    _account()
    workers.start(scheduler=True)
    workers.start(simple=True)
    results = [task_jobs.credit_rq.enqueue("acct", "C-1", 10) for _ in range(3)]
    for result in results:
        assert _refreshed(result, crew=workers).status == OK, result.errors
        assert result.return_value == {"credited": 10}
    assert Account.objects.get().balance == 10
    assert int(rconn.get("test:effects:C-1")) == 1
    outcomes = [TaskJob.fetch(r.id, connection=rconn).meta["joblock"]["outcome"] for r in results]
    assert sorted(outcomes) == ["ran", "replayed", "replayed"], outcomes


@pytest.mark.slow
def test_rq_hot_resource_drains_fifo_parked_not_requeued(workers, rconn):
    workers.start(scheduler=True)
    workers.start()
    workers.start(simple=True)
    first = task_jobs.hold.enqueue(1, "t0", 1.5)
    pid_of(rconn, "t0")
    rest = [task_jobs.hold.enqueue(1, f"t{n}", 0.1) for n in range(1, 6)]
    parked = task_jobs.hold.get_result(rest[-1].id)  # django-tasks-rq 0.12: KeyError
    assert parked.status == READY
    plain = jobs.hold_resource.delay(2, "plain", 0.1)  # a plain RQ job on the same workers
    for result in [first, *rest]:
        assert _refreshed(result, crew=workers).status == OK, result.errors
    assert wait_status(plain, DONE, 30).value == "finished", workers.logs()
    spans = intervals(rconn)
    ends = sorted((spans[f"t{n}"] for n in range(6)), key=lambda span: span[0])
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends)), "never overlapped"
    if not admission.supported():
        return  # rq 2.x: the requeue path, not FIFO
    order = [raw.decode() for raw in rconn.lrange("test:started", 0, -1)]
    assert [label for label in order if label.startswith("t")] == [f"t{n}" for n in range(6)]
    metas = [TaskJob.fetch(r.id, connection=rconn).meta["joblock"] for r in rest]
    assert all(m["admission"] == "rate_limit" and not m.get("requeues") for m in metas), metas


@pytest.mark.slow
def test_rq_killed_holder_is_taken_over_with_a_larger_fence(workers, rconn):
    _account()
    workers.start(scheduler=True)
    killed = task_jobs.credit_rq.enqueue("acct", "K-1", 10, 60.0)
    horse = pid_of(rconn, "K-1")
    info = lock_info("account:acct")
    assert info is not None and info.pid == horse, info
    os.kill(horse, signal.SIGKILL)
    newer = task_jobs.credit_rq.enqueue("acct", "K-2", 5)
    assert _refreshed(newer, crew=workers).status == OK, newer.errors
    fences = dict(raw.decode().split(":") for raw in rconn.lrange("test:fences", 0, -1))
    assert int(fences["K-2"]) > info.fence, (fences, info.fence)
    assert "K-1" not in fences, "the killed run never wrote"
    assert Account.objects.get().balance == 5
    assert _refreshed(killed, crew=workers).status == FAILED  # RQ: abandoned, visible


def _pause_past_ttl(workers, rconn, task):  # type: ignore[no-untyped-def]
    """The holder of account:acct waits for its go flag; SIGSTOPped past its TTL, a newer
    task writes 2; then the holder resumes into its own write of 1."""
    _account()
    workers.start()
    workers.start()
    paused = task.enqueue("acct", "P", 1)
    horse = pid_of(rconn, "P")
    os.kill(horse, signal.SIGSTOP)
    try:
        time.sleep(2.5)  # past the 2 s TTL: the lock expires on the server
        rconn.set("test:go:Q", 1)
        newer = task.enqueue("acct", "Q", 2)
        assert _refreshed(newer, 30, workers).status == OK, newer.errors
        assert Account.objects.get().balance == 2
        rconn.set("test:go:P", 1)
    finally:
        os.kill(horse, signal.SIGCONT)
    return _refreshed(paused, 30, workers)


@pytest.mark.slow
def test_rq_stale_write_of_a_paused_holder_is_refused(workers, rconn, settings):
    settings.JOBLOCK = {**settings.JOBLOCK, "ON_LOCK_LOST": "flag"}
    workers.joblock = settings.JOBLOCK
    paused = _pause_past_ttl(workers, rconn, task_jobs.paused_write)
    assert paused.status == FAILED
    assert paused.errors[0].exception_class_path.endswith("StaleFence"), paused.errors
    assert Account.objects.get().balance == 2, "the newer holder's write stands"


@pytest.mark.slow
def test_rq_without_the_fence_the_stale_write_lands(workers, rconn, settings):
    """Negative control for the test above."""
    settings.JOBLOCK = {**settings.JOBLOCK, "ON_LOCK_LOST": "flag"}
    workers.joblock = settings.JOBLOCK
    paused = _pause_past_ttl(workers, rconn, task_jobs.unfenced_write)
    assert paused.status == OK
    assert Account.objects.get().balance == 1, "the stale write overwrote 2"
    assert wait_for(lambda: rconn.llen("test:written") == 2, 5)


@pytest.mark.slow
def test_rq_requeued_task_returns_its_last_runs_value(workers, rconn):
    workers.start(scheduler=True)
    workers.start()
    first = task_jobs.hold.enqueue(3, "r0", 3.0)
    pid_of(rconn, "r0")
    second = task_jobs.hold_requeue_only.enqueue(3, "r1", 0.1)
    assert _refreshed(second, crew=workers).status == OK, second.errors
    assert TaskJob.fetch(second.id, connection=rconn).meta["joblock"]["requeues"] >= 1
    # django-tasks-rq 0.12 returned the first try's value: the Retry of the requeue (None).
    assert second.return_value == "r1"
    assert _refreshed(first, crew=workers).return_value == "r0"


def test_takes_context_passes_the_context_and_keeps_it_out_of_templates(rconn):
    first = task_jobs.with_context.enqueue(1, 5)
    assert first.status == OK, first.errors
    assert first.return_value == {"id": first.id, "attempts": 1, "lock": "res:1", "n": 5}
    again = task_jobs.with_context.enqueue(1, 5)  # same key, same fingerprint: replayed
    assert again.status == OK and again.return_value == first.return_value
    with pytest.raises(TypeError, match="missing a required argument"):
        task_jobs.with_context.enqueue(1)


def test_dedupe_gives_one_rq_job_per_key(rconn):
    first = task_jobs.deduped.enqueue(1, 7)
    second = task_jobs.deduped.enqueue(1, 7)
    assert first.id == second.id
    assert task_jobs.deduped.get_result(first.id).status == READY
    with pytest.raises(IdempotencyKeyMismatch):
        task_jobs.deduped.enqueue(2, 7)  # the same key with other arguments
    assert task_jobs.deduped.enqueue(1, 8).id != first.id


@pytest.mark.slow
def test_rq_context_and_run_after(workers, rconn):
    workers.start(scheduler=True)
    asked = timezone.now()
    task = task_jobs.with_context_rq.using(run_after=asked + timedelta(seconds=2))
    later = task.enqueue(2, 6)
    assert task_jobs.with_context_rq.get_result(later.id).status == READY
    assert _refreshed(later, crew=workers).status == OK, later.errors
    assert later.return_value == {"id": later.id, "attempts": 1, "lock": "res:2", "n": 6}
    assert later.started_at >= asked + timedelta(seconds=1), "ran at run_after (RQ: whole seconds)"


@pytest.mark.slow
def test_django_rq_rqworker_runs_tasks_with_the_job_class(workers, rconn):
    _account()
    plain = task_jobs.credit_rq.enqueue("acct", "W-1", 3)
    # Negative control: rqworker with RQ's own job class cannot run a task (no such call).
    workers.start(command="rqworker", burst=True).wait(60)
    assert _refreshed(plain, crew=workers).status == FAILED
    assert Account.objects.get().balance == 0
    result = task_jobs.credit_rq.enqueue("acct", "W-2", 4)
    workers.extra_args = ["--job-class=django_joblock.jobs.rq_tasks.Job"]
    workers.start(command="rqworker", burst=True).wait(60)
    assert _refreshed(result, crew=workers).status == OK, result.errors
    assert Account.objects.get().balance == 4


@pytest.mark.slow
def test_plain_async_rq_job_still_runs_on_the_task_aware_worker(workers, rconn):
    """joblock_worker's job class (tasks and plain jobs) awaits a plain async job as RQ does."""
    job = get_queue("default").enqueue(task_jobs.plain_async, 21)
    workers.start(simple=True, burst=True).wait(60)
    assert wait_status(job, DONE, 30).value == "finished", workers.logs()
    assert job.return_value(refresh=True) == 42


def _nowhere(n: int) -> int:
    return n


_nowhere.__qualname__ = _nowhere.__name__ = "nowhere_task"  # module level for Django's checks


def test_checks_look_only_at_tasks_that_run_on_rq(settings):
    """A task on the database backend has no RQ queue: no E006 for a queue name RQ_QUEUES
    lacks, no W012 for its scheduler; a @locked_job on that queue name gets E006."""
    before = dict(registry)
    try:
        made = locked_task(lock="n:{n}", backend="db", queue_name="nowhere")(_nowhere)
        assert not made.spec.on_rq and task_jobs.credit_rq.spec.on_rq
        call_command("check")  # no SystemCheckError
        locked_job("nowhere", lock="n:{n}")(_nowhere)  # the control: the same as an RQ job
        with pytest.raises(SystemCheckError, match=r"E006.*nowhere"):
            call_command("check")
    finally:
        registry.clear()
        registry.update(before)


def test_a_priority_is_refused_by_the_rq_backend_and_honoured_inline(rconn):
    """docs/tasks.md: ``priority`` is for the backends that support it; the RQ backend refuses
    a task with another priority than the default at ``.enqueue()``, and enqueues nothing."""
    from django_tasks.exceptions import InvalidTaskError  # django-tasks-rq's, on Django 6 too

    _account()
    queued = rconn.llen("rq:queue:default")
    with pytest.raises(InvalidTaskError, match="does not support setting priority"):
        task_jobs.credit_rq.using(priority=10).enqueue("acct", "P-1", 1)
    assert rconn.llen("rq:queue:default") == queued, "nothing enqueued"
    result = task_jobs.credit_inline.using(priority=10).enqueue("acct", "P-2", 1)
    assert result.status == OK, "negative control: the immediate backend runs it"


@pytest.mark.parametrize("takes_context", [False, True])
def test_an_async_generator_is_refused_at_decoration_with_or_without_context(takes_context):
    async def credit(context: object, name: str) -> Any:
        yield name

    with pytest.raises(TypeError, match=r"@locked_task .*credit: an async generator is not"):
        locked_task(lock="account:{name}", takes_context=takes_context)(credit)


def test_an_async_task_inline_applies_once_and_replays(rconn):
    _account()
    first = task_jobs.acredit_inline.enqueue("acct", "A-1", 10)
    second = task_jobs.acredit_inline.enqueue("acct", "A-1", 10)
    assert (first.status, second.status) == (OK, OK), (first.errors, second.errors)
    assert first.return_value == second.return_value
    assert first.return_value["credited"] == 10
    assert Account.objects.get().balance == 10
    assert int(rconn.get("test:effects:A-1")) == 1, "the body ran once"


def test_an_async_task_with_its_context_inline(rconn):
    _account()
    result = task_jobs.acredit_with_context.enqueue("acct", "A-2", 5)
    assert result.status == OK, result.errors
    assert result.return_value["attempt"] == 1 and result.return_value["credited"] == 5
    assert Account.objects.get().balance == 5


@pytest.mark.slow
def test_an_async_task_on_the_rq_backend_applies_duplicates_once(workers, rconn):
    _account()
    # With the scheduler, as the other tests here: on rq 2.x (no admission) a duplicate that
    # finds the lock busy is requeued with a delay, which only RQ's scheduler moves back.
    workers.start(scheduler=True)
    workers.start(simple=True)
    results = [task_jobs.acredit_rq.enqueue("acct", "A-3", 10) for _ in range(2)]
    for result in results:
        assert _refreshed(result, crew=workers).status == OK, result.errors
    assert Account.objects.get().balance == 10
    assert int(rconn.get("test:effects:A-3")) == 1


def credit_anywhere(name: str) -> None:
    """A task function at module level (Django's tasks refuse local ones)."""


def test_a_task_on_django_tasks_rqs_own_backend_is_refused_at_decoration(
    settings, scratch_registry
):
    """django-tasks-rq's own backend was accepted silently: it enqueued without the flow (no
    admission, a requeue's ``Retry`` stored as the task's return value)."""
    from django_joblock import JoblockConfigError

    settings.TASKS = {
        **settings.TASKS,
        "plain": {"BACKEND": "django_tasks_rq.RQBackend", "QUEUES": ["default"]},
    }

    with pytest.raises(JoblockConfigError, match=r"TASKS\['plain'\] is django_tasks_rq\.\S+"):
        locked_task(lock="account:{name}", backend="plain")(credit_anywhere)
    assert locked_task(lock="account:{name}", backend="rq")(credit_anywhere).spec.on_rq, (
        "negative control: ours is accepted"
    )


def test_a_task_on_a_worker_without_the_task_job_class_fails_saying_so(rconn, caplog):
    """On a worker with RQ's own job class a task failed with ``AttributeError: ...
    task_result`` from django-tasks-rq's callback; now its failure names the job class."""
    from rq.job import Job as PlainJob

    from django_joblock.jobs.rq_tasks import WRONG_JOB_CLASS
    from django_joblock.worker import JoblockSimpleWorker

    _account()
    result = task_jobs.credit_rq.enqueue("acct", "W-1", 1)
    queue = get_queue("default")
    worker = JoblockSimpleWorker([queue], connection=queue.connection, job_class=PlainJob)
    worker.work(burst=True)
    job = queue.fetch_job(result.id)
    assert job.get_status() == "failed", "negative control: RQ's job class cannot run a task"
    assert WRONG_JOB_CLASS in job.latest_result().exc_string
    assert "task_result" not in job.latest_result().exc_string


def test_a_missing_result_is_the_task_frameworks_error_on_every_django(rconn):
    """On Django 6, ``except django.tasks.exceptions.TaskResultDoesNotExist`` missed the RQ
    backend's error (django-tasks-rq raises the backport's); it is both now."""
    from django_tasks.exceptions import TaskResultDoesNotExist as Backport

    with pytest.raises(Backport):
        task_jobs.credit_rq.get_result("no-such-result")
    try:
        from django.tasks.exceptions import TaskResultDoesNotExist
    except ImportError:  # Django 5.2: the backport is the framework
        return
    with pytest.raises(TaskResultDoesNotExist):
        task_jobs.credit_rq.get_result("no-such-result")


def test_a_task_rq_marks_scheduled_before_registering_it_is_read_once_registered(rconn):
    """rq writes a retried job's ``scheduled`` status before its pipeline adds the job to the
    scheduled registry (and its scheduler moves due jobs out): django-tasks-rq's read of the
    scheduled time then finds none. Such a read is repeated (CI: a requeued task's refresh
    raised ResultDoesNotExist on a busy box); a task that is gone is not."""
    import threading

    from django_tasks.exceptions import TaskResultDoesNotExist
    from rq.registry import ScheduledJobRegistry

    task = task_jobs.with_context_rq.enqueue(2, 6)
    job = TaskJob.fetch(task.id, connection=rconn)
    queue = get_queue("default")
    queue.remove(job)
    rconn.hset(job.key, "status", "scheduled")  # rq's set_status, before its pipeline runs
    at = timezone.now() + timedelta(seconds=30)
    pipeline_runs = threading.Timer(0.3, ScheduledJobRegistry(queue=queue).schedule, (job, at))
    pipeline_runs.start()
    try:
        result = task_jobs.with_context_rq.get_result(task.id)
    finally:
        pipeline_runs.join()
    assert result.status == READY
    assert result.task.run_after is not None
    assert abs((result.task.run_after - at).total_seconds()) < 1
    job.delete()
    with pytest.raises(TaskResultDoesNotExist):
        task_jobs.with_context_rq.get_result(task.id)


def test_a_task_on_a_queue_of_another_redis_database_has_its_result(rconn, settings):
    """Review bug: ``get_result()`` (and ``TaskResult.refresh()``) looked for the RQ job on
    django-rq's ``"default"`` connection only, so a task enqueued on a queue of another Redis
    database raised ``TaskResultDoesNotExist`` at once. It is looked for on each queue's."""
    from django_tasks.exceptions import TaskResultDoesNotExist

    from tests import harness

    other_db = harness.redis_url().rsplit("/", 1)[0] + "/3"
    settings.RQ_QUEUES = {**settings.RQ_QUEUES, "other": {"URL": other_db}}
    settings.TASKS = {
        **settings.TASKS,
        "rq": {**settings.TASKS["rq"], "QUEUES": ["default", "other"]},
    }
    task = task_jobs.with_context_rq.using(queue_name="other")
    try:
        result = task.enqueue(2, 6)
        assert get_queue("other").get_job_ids() == [result.id]
        assert not rconn.exists(f"rq:job:{result.id}"), "not on the default queue's database"
        found = task.get_result(result.id)
        assert found.id == result.id and found.status == READY
        assert found.task.queue_name == "other"
        result.refresh()
        assert result.status == READY
        with pytest.raises(TaskResultDoesNotExist):
            task.get_result("no-such-result")
    finally:
        get_queue("other").connection.flushdb()

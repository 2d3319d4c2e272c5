"""A paused process is not a dead one (docs/architecture.md, "Recovery"): real worker processes
stopped with SIGSTOP and resumed, or asked to stop twice, never run a job twice that RQ alone
would run once, never hang, and a stopped holder's transaction holds its resource back for no
longer than its lock's TTL. Each fault has its negative control."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from rq import Queue, Worker
from rq.job import JobStatus
from rq.scheduler import RQScheduler

from django_joblock.backend import text
from django_joblock.jobs import admission
from tests import admission_jobs, task_jobs
from tests.harness import wait_for
from tests.procs.load import BusyCores
from tests.testapp.models import Account
from tests.workers import DONE, Workers, pid_of, wait_status

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TASKS = 400
STOPS = {"the scheduler process": 8.0, "the whole worker": 6.0}
UNSAFE = "--worker-class=tests.unsafe_workers.TakeOverWorker"


@pytest.fixture
def crews(settings) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    """``crews(*extra_args)``: joblock_worker processes, all stopped after the test."""
    settings.JOBLOCK = {"REQUEUE_BACKOFF": {"base": 0.5, "factor": 2, "max": 2}}
    made: list[Workers] = []

    def make(*extra: str) -> Workers:
        made.append(Workers(settings.JOBLOCK, extra_args=list(extra)))
        return made[-1]

    yield make
    for crew in made:
        crew.stop()


def _scheduler_owner(rconn: Any) -> str | None:
    owner = rconn.get(RQScheduler.get_locking_key("default"))
    return None if owner is None else text(owner)


def _scheduler_pid(rconn: Any) -> int:
    """The pid of the scheduler process holding the lock (it registers once it has forked)."""
    owner = _scheduler_owner(rconn)
    assert owner is not None, "a scheduler runs"
    key = RQScheduler([], connection=rconn, name=owner).key
    assert wait_for(lambda: rconn.exists(key), 20), "the scheduler process registered"
    return RQScheduler.fetch(owner, connection=rconn).pid


def _paused_while_scheduling(
    crew: Workers, rconn: Any, what: str, until_taken_over: bool = False
) -> tuple[dict[int, int], int]:
    """Two workers with ``--with-scheduler``; TASKS lock-only tasks due in a few seconds, on as
    many resources. As the scheduler starts moving them to the queue, ``what`` is stopped for
    STOPS[what] seconds (``until_taken_over``: until another scheduler holds the lock and has
    moved the rest, up to 60 s), then resumed. Returns (task -> its runs, tasks not yet moved at
    the stop)."""
    first = crew.start("default", scheduler=True)
    assert wait_for(lambda: _scheduler_owner(rconn), 30), crew.logs()
    owner = _scheduler_owner(rconn)
    scheduler_pid = _scheduler_pid(rconn)
    crew.start("default", scheduler=True)
    assert wait_for(lambda: len(Worker.all(connection=rconn)) == 2, 30), crew.logs()
    due = timezone.now() + timedelta(seconds=8)
    task = task_jobs.count_run.using(run_after=due)
    for n in range(TASKS):
        task.enqueue(n)
    registry = Queue("default", connection=rconn).scheduled_job_registry
    assert timezone.now() < due and registry.count == TASKS, "all scheduled before they are due"
    while registry.count == TASKS:  # the scheduler starts moving them: stop it in the act
        pass
    if what == "the scheduler process":
        os.kill(scheduler_pid, signal.SIGSTOP)
    else:
        os.killpg(first.pid, signal.SIGSTOP)  # the worker and its scheduler (not a horse)
    left = registry.count
    try:
        time.sleep(STOPS[what])
        if until_taken_over:
            moved = lambda: _scheduler_owner(rconn) not in (None, owner) and registry.count == 0  # noqa: E731
            assert wait_for(moved, 60), f"negative control: taken over\n{crew.logs()}"
    finally:
        if what == "the scheduler process":
            os.kill(scheduler_pid, signal.SIGCONT)
        else:
            os.killpg(first.pid, signal.SIGCONT)
    ran = lambda: rconn.hlen("test:runs") == TASKS  # noqa: E731
    assert wait_for(ran, 120), f"{rconn.hlen('test:runs')} of {TASKS} ran\n{crew.logs()}"
    queue = Queue("default", connection=rconn)
    drained = lambda: queue.count == 0 and registry.count == 0  # noqa: E731
    assert wait_for(drained, 60), crew.logs()
    time.sleep(3)  # a second run of a task enqueued again at the resume has had time to end
    runs = {int(n): int(count) for n, count in rconn.hgetall("test:runs").items()}
    assert _scheduler_owner(rconn) is not None and owner is not None
    return runs, left


# On rq >= 3 the scheduler moves rate-limited jobs (admission) one by one: a stop lands in the
# middle. rq 2.x moves them in one transaction, so the stop comes after it.
ONE_BY_ONE = admission.supported()


@pytest.mark.parametrize("what", list(STOPS))
def test_a_paused_scheduler_runs_no_scheduled_job_twice(what, crews, rconn):
    """RQ's scheduler (or its whole worker) is stopped in the middle of moving due jobs to the
    queue, for longer than the 4 s after which the workers used to take a scheduler for dead.
    Nothing takes its lease (RQ's lock lives 61 s), so when it resumes it finishes its round
    alone: every task runs once. The negative control is the next test."""
    runs, left = _paused_while_scheduling(crews(), rconn, what)
    if ONE_BY_ONE:
        assert 0 < left < TASKS, f"negative control: stopped mid-enqueue ({left} left)"
    assert sorted(runs) == list(range(TASKS)), "every task ran"
    twice = sorted(n for n, count in runs.items() if count > 1)
    assert twice == [], f"{len(twice)} of {TASKS} tasks ran twice"
    print(f"\n{what} stopped {STOPS[what]:g} s with {left} of {TASKS} left to enqueue: 0 twice")


@pytest.mark.skipif(not ONE_BY_ONE, reason="rq 2.x moves due jobs in one transaction")
def test_negative_control_a_take_over_after_4_s_runs_scheduled_jobs_twice(crews, rconn):
    """The same pause with the take-over the workers had (a scheduler whose lock was not renewed
    for 4 s is taken for dead, tests/unsafe_workers.py): the other worker's scheduler enqueues
    the due jobs, the paused one resumes and enqueues those it had read again. The whole worker
    is stopped: a worker whose own scheduler process alone is stopped takes its own lock over
    (the process is alive, so none is started) about as often as the other worker does. The
    pause lasts until the other worker's scheduler has moved the rest (not a fixed time: on a
    busy machine it can take longer)."""
    runs, left = _paused_while_scheduling(
        crews(UNSAFE), rconn, "the whole worker", until_taken_over=True
    )
    assert 0 < left < TASKS, f"stopped mid-enqueue ({left} left)"
    twice = sorted(n for n, count in runs.items() if count > 1)
    assert twice, "the take-over ran no task twice"
    print(f"\nnegative control: {len(twice)} of {TASKS} tasks ran twice")


# The SIGTERM scenario: runs per test (JOBLOCK_TEST_SIGTERM_RUNS, e.g. 20 for a longer trial).
SIGTERM_RUNS = int(os.environ.get("JOBLOCK_TEST_SIGTERM_RUNS", "3"))
AFTER_STOP = 2.0  # seconds the job goes on after the stop request
EXIT_BOUND = 10.0  # seconds after its job's end within which a stopping worker exits


def _stopped_twice_mid_job(
    crew: Workers, rconn: Any, run: int, *first_args: str
) -> tuple[float | None, str]:
    """A worker running RQ's scheduler (with ``first_args``), a second one beside it; a job runs
    on the first, which gets two SIGTERMs 0.3 s apart. Returns (seconds from the job's end to the
    worker's exit, or None if it had not exited EXIT_BOUND + 5 s after the job's end; the first
    worker's log)."""
    # RQ's maintenance pass is due after the job (every second), and RQ's would start a
    # scheduler in place of the one the stop request stopped.
    crew.extra_args = ["--maintenance-interval=1", *first_args]
    first = crew.start("default", scheduler=True)
    crew.extra_args = []
    assert wait_for(lambda: _scheduler_owner(rconn), 30), crew.logs()
    _scheduler_pid(rconn)  # its scheduler process runs
    label = f"stopped-{run}"
    # Held until the test lets it go: on a busy machine the second worker took longer to
    # register than a job of fixed length ran (CI), and the signals came after it.
    job = admission_jobs.hot_hold.delay(400 + run, label)
    pid_of(rconn, label)
    second = crew.start("default", scheduler=True)
    ours = {first.pid, second.pid}  # the workers of earlier runs were killed unregistered
    registered = lambda: {each.pid for each in Worker.all(connection=rconn)} >= ours  # noqa: E731
    assert wait_for(registered, 30), crew.logs()
    assert job.get_status(refresh=True) == JobStatus.STARTED, "negative control: mid-job"
    first.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    first.send_signal(signal.SIGTERM)
    time.sleep(AFTER_STOP)
    rconn.set(f"test:go:{label}", 1)
    status = wait_status(job, DONE, 30, crew)
    job.refresh()
    path = crew.log_paths[crew.procs.index(first)]
    if status is not JobStatus.FINISHED:
        # RQ ignores a second signal within 1 s of handling the first; on a busy machine it
        # may handle them further apart: a cold shutdown, which kills the horse (RQ's rule).
        assert "cold shut down" in path.read_text(errors="replace"), crew.logs()
    ended = job.ended_at.timestamp() if job.ended_at is not None else time.time()
    try:
        first.wait(max(0.0, ended + EXIT_BOUND + 5 - time.time()))
        exited_after: float | None = time.time() - ended
    except subprocess.TimeoutExpired:
        exited_after = None
    return exited_after, path.read_text(errors="replace")


def _started_after_stop(log: str) -> bool:
    """Did the worker start a scheduler process after it was asked to stop?"""
    _before, asked, after = log.partition("warm shut down requested")
    assert asked, f"negative control: the worker got the stop request\n{log}"
    return "Scheduler for default started" in after


@pytest.mark.parametrize("busy", [False, True], ids=["quiet", "cores busy"])
def test_a_worker_asked_to_stop_twice_mid_job_exits_after_its_job(busy, crews, rconn):
    """SIGTERM during a job stops RQ's scheduler; the workers' sweep after the job then started a
    new one, which the worker's exit SIGTERMed before it had its own handlers and waited on for
    ever (2 of 7 runs hung); RQ's own maintenance pass, when due after the job, does the same.
    A worker asked to stop starts nothing, and exits within its job's end + 10 s, with the cores
    busy too. The negative control is the next test."""
    exits = []
    load = BusyCores() if busy else None
    with load if load is not None else contextlib.nullcontext():
        for run in range(SIGTERM_RUNS):
            crew = crews()
            exited_after, log = _stopped_twice_mid_job(crew, rconn, run)
            crew.stop()
            assert not _started_after_stop(log), log
            assert exited_after is not None, f"run {run}: no exit 15 s after its job\n{log}"
            assert exited_after <= EXIT_BOUND, f"run {run}: exited {exited_after:.1f}s after it"
            exits.append(exited_after)
    if load is not None:
        assert load.cpu > 0, "negative control: the load really ran"
    shown = ", ".join(f"{after:.1f}" for after in exits)
    print(f"\n{SIGTERM_RUNS} runs ({'busy' if busy else 'quiet'}): exits {shown} s after the job")


def test_negative_control_the_old_sweep_starts_a_scheduler_once_asked_to_stop(crews, rconn):
    """The same signals to a worker with the old take-over in its sweep (tests/unsafe_workers.py;
    the worker beside it is ours, which leaves the vacant scheduler lock alone): after the job
    it starts a scheduler process although it was asked to stop (which hung the exit when the
    scheduler got its SIGTERM before its own signal handlers). Whether its sweep runs after
    the stopped scheduler let its lock go depends on timing: up to 3 tries, one must show it."""
    logs = []
    for run in range(3):
        crew = crews()
        _exited_after, log = _stopped_twice_mid_job(crew, rconn, run, UNSAFE)
        crew.stop()  # a scheduler started after the stop is killed with its process group,
        rconn.flushdb()  # and the lock it held must not keep the next try's scheduler out
        logs.append(log)
        if _started_after_stop(log):
            return
    raise AssertionError("the old sweep started no scheduler in 3 tries\n" + "\n".join(logs))


def _commits(rconn: Any) -> list[tuple[str, float]]:
    found = []
    for raw in rconn.lrange("test:commits", 0, -1):
        label, at = text(raw).rsplit(":", 1)
        found.append((label, float(at)))
    return found


def _guard_holders_idle_in_transaction() -> list[int]:
    """Backends holding an advisory lock (a resource's or a key's guard) in this test database,
    idle in a transaction (suites running beside this one hold theirs in their own databases)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT a.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND a.state LIKE 'idle in transaction%%'"
        )
        return [row[0] for row in cursor.fetchall()]


def test_a_worker_stopped_for_good_mid_transaction_holds_its_resource_for_one_ttl(crews, rconn):
    """A worker is SIGSTOPped for good inside a job's transaction on PostgreSQL (its horse too),
    three jobs of the resource parked behind it. Its lock expires after its TTL; the next job
    takes the lock, finds the stopped transaction holding the resource's guard, and ends it
    (idle past half the TTL: it rolls back). The next job commits within the TTL + 10 s of the
    stop, the three in their enqueue order, none requeued (rq >= 3; on rq 2.x, without
    admission, they requeue until the lock is free and commit in no particular order).
    Negative control: the stopped backend really held the guard, idle in its transaction,
    until it was ended."""
    from django_joblock.idempotency.resource_guard import guarded

    if connection.vendor != "postgresql":
        # SQLite has no guard: the stopped transaction holds the database's write lock until
        # its process dies (docs/architecture.md, "Recovery").
        assert not guarded("default")
        return
    Account.objects.create(name="paused", balance=0)
    crew = crews()
    first = crew.start("default")
    holder = admission_jobs.append_in_order.delay("paused", "stopped", True)
    horse = pid_of(rconn, "stopped")
    crew.start("default", scheduler=True)  # rq 2.x: the next jobs requeue (scheduled)
    parked = [admission_jobs.append_in_order.delay("paused", f"next-{n}", False) for n in range(3)]
    if admission.supported():
        assert all(job.get_status(refresh=True) == "rate_limited" for job in parked)
    stale = _guard_holders_idle_in_transaction()
    assert len(stale) == 1, f"negative control: the holder's transaction holds the guard {stale}"
    os.killpg(first.pid, signal.SIGSTOP)
    os.kill(horse, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        done = lambda: len(_commits(rconn)) == 3  # noqa: E731
        assert wait_for(done, admission_jobs.PAUSE_TTL + 30), crew.logs()
        commits = _commits(rconn)
        first_commit = commits[0][1] - stopped_at
        assert first_commit <= admission_jobs.PAUSE_TTL + 10, f"{first_commit:.1f}s after the stop"
        for job in parked:
            assert wait_status(job, DONE, 10) is JobStatus.FINISHED
        if admission.supported():  # rq 2.x has no admission: its jobs requeue, in no order
            assert [label for label, _at in commits] == ["next-0", "next-1", "next-2"], commits
            for job in parked:
                assert job.get_meta(refresh=True)["joblock"].get("requeues", 0) == 0, job.meta
        assert stale[0] not in _guard_holders_idle_in_transaction(), "its transaction was ended"
        assert "ended the transaction of its previous holder" in crew.logs()
        assert Account.objects.get(name="paused").balance == 3, (
            "the stopped run's write rolled back"
        )
    finally:
        os.kill(horse, signal.SIGKILL)
        os.killpg(first.pid, signal.SIGKILL)
    assert holder.get_status(refresh=True) == JobStatus.STARTED, "stopped, never recorded"
    print(f"\nworker stopped for good: the next job committed {first_commit:.1f} s after the stop")

"""Liveness through real worker processes: after a fault on the job holding a hot resource, the
next parked job starts within the holder's lock TTL + 5 s (docs/jobs.md, "When the slot
frees"), whatever state RQ's maintenance is in. Each fault is also applied to plain RQ with
``RateLimit`` (the negative control): there the parked job still waits when ours has run.

The holder (``hot_hold``, TTL 2 s) runs on the first worker; a second worker is idle. Time is
measured from the fault to the start of the parked job's body (its own clock reading).
"""

from __future__ import annotations

import inspect
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from rq import Queue, Worker
from rq.command import send_stop_job_command
from rq.job import JobStatus
from rq.scheduler import RQScheduler

from django_joblock import lock, lock_info
from django_joblock.jobs import admission, liveness
from django_joblock.monitor.control import force_release
from django_joblock.worker import JoblockWorker
from tests import admission_jobs
from tests.harness import free_port, persistent, wait_for
from tests.workers import DONE, Workers, exited, intervals, pid_of, wait_status

pytestmark = pytest.mark.django_db(transaction=True)

RATE_LIMITED = admission.supported()
# The slot tests are about RQ's RateLimit slot, which rq 2.x does not have (its jobs requeue).
slots = pytest.mark.skipif(not RATE_LIMITED, reason="rq 2.x has no RateLimit slot to free")

TTL = admission_jobs.HOT_TTL
BOUND = TTL + 5  # the design's bound: the dead holder's lock TTL + 5 s
WATCH = BOUND + 8  # how long the negative control is watched (RQ's own bound is >= 60 s)


@pytest.fixture
def crews(settings) -> Iterator[Callable[[bool], Workers]]:  # type: ignore[no-untyped-def]
    """``crews(ours)``: joblock_worker processes, or plain RQ workers (django-rq's rqworker with
    RQ's own Worker class) for the negative controls."""
    settings.JOBLOCK = {"REQUEUE_BACKOFF": {"base": 1, "factor": 2, "max": 4}}
    made: list[Workers] = []

    def make(ours: bool) -> Workers:
        extra = [] if ours else ["--worker-class=rq.Worker"]
        made.append(Workers(settings.JOBLOCK, extra_args=extra))
        return made[-1]

    yield make
    for crew in made:
        crew.stop()


class Scene:
    """A holder running on the first worker of ``crew``, one parked job behind it, and a second
    worker idle: ours (``@locked_job``) or plain RQ with ``RateLimit(concurrency=1)``."""

    def __init__(self, crew: Workers, rconn: Any, ours: bool, resource: int) -> None:
        self.crew, self.rconn, self.ours = crew, rconn, ours
        self.first = crew.start("default", command="joblock_worker" if ours else "rqworker")
        if ours:
            self.holder = admission_jobs.hot_hold.delay(resource, "holder")
        else:
            queue = Queue("default", connection=rconn)
            limit = admission.RateLimit(key=f"plain:{resource}", concurrency=1)
            self.holder = queue.enqueue(
                admission_jobs.plain_hold, args=("holder",), rate_limit=limit
            )
        self.horse = pid_of(rconn, "holder")
        crew.start("default", command="joblock_worker" if ours else "rqworker")
        if ours:
            self.parked = admission_jobs.hot.delay(resource, "next", 0.05)
        else:
            self.parked = queue.enqueue(
                admission_jobs.plain_interval, args=("next", 0.05), rate_limit=limit
            )
        assert self.parked.get_status(refresh=True) == "rate_limited", "parked behind the holder"
        time.sleep(0.5)  # the idle worker is in its dequeue loop

    def started_after(self, fault_at: float, watch: float) -> float | None:
        """Seconds from ``fault_at`` to the parked job's start, or None if it did not start (its
        body ran) within ``watch`` seconds of the fault."""
        wait_for(lambda: "next" in intervals(self.rconn), fault_at + watch - time.time())
        spans = intervals(self.rconn)
        return spans["next"][0] - fault_at if "next" in spans else None


def _kill_horse(scene: Scene) -> None:
    os.kill(scene.horse, signal.SIGKILL)
    assert wait_for(lambda: exited(scene.horse), 10), "negative control: the horse was killed"


def _kill_worker(scene: Scene) -> None:
    os.killpg(scene.first.pid, signal.SIGKILL)  # the worker's session ...
    os.kill(scene.horse, signal.SIGKILL)  # ... and its horse, which RQ puts in a session of its own
    assert wait_for(lambda: exited(scene.horse) and exited(scene.first.pid), 10)


def _stop_horse(scene: Scene) -> None:
    os.kill(scene.horse, signal.SIGSTOP)


def _kill_worker_in_maintenance(scene: Scene) -> None:
    """The worker dies holding RQ's maintenance lock (taken just before, as RQ takes it), so
    no worker cleans the registries for 899 s."""
    assert Queue("default", connection=scene.rconn).acquire_maintenance_lock()
    _kill_worker(scene)


FAULTS = {
    "horse SIGKILL": _kill_horse,
    "parent + horse SIGKILL": _kill_worker,
    "horse SIGSTOP past the TTL": _stop_horse,
    "worker killed holding RQ's maintenance lock": _kill_worker_in_maintenance,
}


@slots
@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_next_parked_job_starts_within_the_ttl_after(fault, crews, rconn):
    scene = Scene(crews(True), rconn, ours=True, resource=31)
    try:
        fault_at = time.time()
        FAULTS[fault](scene)
        waited = scene.started_after(fault_at, WATCH)
        assert waited is not None and waited <= BOUND, (
            f"{fault}: the parked job started {waited} s after the fault (bound {BOUND} s)\n"
            + scene.crew.logs()
        )
        assert wait_status(scene.parked, DONE, 10) is JobStatus.FINISHED
        print(f"\n{fault}: the next parked job started {waited:.2f} s after the fault")
    finally:
        with_horse = fault == "horse SIGSTOP past the TTL"
        if with_horse and not exited(scene.horse):
            os.kill(scene.horse, signal.SIGCONT)
    assert "holder" not in intervals(rconn), "the holder never finished its body"
    # Never dropped: failed by its worker, or "started" until RQ's maintenance gives it up.
    assert scene.holder.get_status(refresh=True) in (JobStatus.FAILED, JobStatus.STARTED)


@slots
@pytest.mark.parametrize(
    "fault",
    [
        "parent + horse SIGKILL",
        "horse SIGSTOP past the TTL",
        "worker killed holding RQ's maintenance lock",
    ],
)
def test_negative_control_plain_rq_rate_limit_stalls_after(fault, crews, rconn):
    """The same faults on plain RQ workers and ``RateLimit``: RQ frees the slot only when its
    maintenance gives the job up (its execution expires 60 s after the last heartbeat at the
    least, and RQ's workers run maintenance every 600 s) or the stopped horse's job_timeout."""
    scene = Scene(crews(False), rconn, ours=False, resource=32)
    try:
        fault_at = time.time()
        FAULTS[fault](scene)
        assert scene.started_after(fault_at, WATCH) is None, "plain RQ freed the slot early"
        assert scene.parked.get_status(refresh=True) == "rate_limited", "still parked"
    finally:
        if not exited(scene.horse):
            os.kill(scene.horse, signal.SIGKILL)


def _scheduler_owner(rconn: Any) -> bytes | None:
    return rconn.get(RQScheduler.get_locking_key("default"))  # type: ignore[no-any-return]


@pytest.mark.parametrize("ours", [True, False], ids=["joblock_worker", "negative control: rq"])
def test_a_requeued_job_does_not_wait_on_a_dead_scheduler(ours, crews, rconn):
    """A job waits in a backoff (RQ's scheduled registry) when the worker running RQ's
    scheduler dies with it. Another worker with ``--with-scheduler`` takes the scheduler over
    within seconds (RQ's own workers: once its lock expired, 61 s, at their next maintenance)."""
    crew = crews(ours)
    command = "joblock_worker" if ours else "rqworker"
    first = crew.start("default", scheduler=True, command=command)
    assert wait_for(lambda: _scheduler_owner(rconn), 30), crew.logs()
    dead_owner = _scheduler_owner(rconn)
    crew.start("default", scheduler=True, command=command)
    queue = Queue("default", connection=rconn)
    scheduled: list[float] = []

    def due_time() -> bool:  # read while it waits (a busy box may enqueue it soon after)
        score = rconn.zscore(queue.scheduled_job_registry.key, job.id)
        scheduled.extend([] if score is None else [float(score)])
        return score is not None

    if ours:
        with lock("hot:33", ttl=30):  # busy outside admission: the job requeues with a backoff
            job = admission_jobs.hot_outside.delay(33, "next", 0.05)
            assert wait_for(due_time, 20), crew.logs()
    else:
        job = queue.enqueue_in(timedelta(seconds=1), admission_jobs.plain_interval, "next", 0.05)
        assert wait_for(due_time, 20)
    due = scheduled[-1]
    os.killpg(first.pid, signal.SIGKILL)  # the worker and its scheduler process
    fault_at = time.time()
    assert wait_for(lambda: exited(first.pid), 10)
    since = max(fault_at, due)
    wait_for(lambda: "next" in intervals(rconn), since + WATCH - time.time())
    spans = intervals(rconn)
    waited = spans["next"][0] - since if "next" in spans else None
    if not ours:
        assert waited is None, "RQ's scheduler came back early"
        assert _scheduler_owner(rconn) == dead_owner, "the dead scheduler's lock is still there"
        return
    assert waited is not None and waited <= BOUND, f"waited {waited} s\n{crew.logs()}"
    assert _scheduler_owner(rconn) not in (None, dead_owner), "another worker took it over"
    print(f"\nscheduler's worker killed: the requeued job started {waited:.2f} s after it was due")


def _states(rconn: Any) -> list[str]:
    return sorted(worker.get_state() for worker in Worker.all(connection=rconn))


KINDS = [
    "forking",
    "simple",
    "forking, in RQ's maintenance",
    "negative control: rq",
    "negative control: rq, in RQ's maintenance",
]


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.replace(" ", "-"))
def test_a_job_ending_while_redis_restarts_is_recorded_and_the_next_one_starts(
    kind, crews, rconn, server
):
    """Redis goes down (append-only file on) while a job runs, and the job ends during the
    outage. Our workers wait for Redis, record the job's end, and the parked job starts within
    the TTL + 5 s of Redis being back. RQ's forking horse exits without recording anything, its
    worker quits (a SimpleWorker too): the job stays "started", its slot taken, until RQ's
    maintenance gives it up (60 s after its last heartbeat at the least).

    "In RQ's maintenance": a registry maintenance pass is under way when Redis goes down, so
    RQ's maintenance lock outlives the restart (for its 899 s) and no worker cleans the
    registries meanwhile; ours free the slot all the same."""
    ours = not kind.startswith("negative control")
    in_maintenance = kind.endswith("in RQ's maintenance")
    crew = crews(ours)
    persistent(server, rconn, True)
    try:
        command = "joblock_worker" if ours else "rqworker"
        simple = kind == "simple"
        first = crew.start("default", command=command, simple=simple)
        queue = Queue("default", connection=rconn)
        # rq 2.x: no RateLimit, nothing parks; the job's end must still be recorded.
        limited = {"rate_limit": admission.RateLimit("plain:34", 1)} if RATE_LIMITED else {}
        if ours:
            holder = admission_jobs.hot_sleep.delay(34, "holder", 2.0)
        else:
            holder = queue.enqueue(admission_jobs.plain_sleep, args=("holder", 2.0), **limited)
        pid_of(rconn, "holder")
        crew.start("default", command=command, simple=simple)
        assert wait_for(lambda: len(Worker.all(connection=rconn)) == 2, 30), crew.logs()
        if RATE_LIMITED and ours:
            parked = admission_jobs.hot.delay(34, "next", 0.05)
        elif RATE_LIMITED:
            parked = queue.enqueue(admission_jobs.plain_interval, args=("next", 0.05), **limited)
        if RATE_LIMITED:
            assert parked.get_status(refresh=True) == "rate_limited"
        cleaning = queue.registry_cleaning_key
        if in_maintenance:  # past the workers' start-up passes: the pass under way is this one
            assert wait_for(lambda: _states(rconn) == ["busy", "idle"], 30), _states(rconn)
            assert queue.acquire_maintenance_lock()
        server.kill()
        time.sleep(3.0)  # the holder's body ends meanwhile
        server.start()
        back_at = time.time()
        waited = None
        if RATE_LIMITED:
            wait_for(lambda: "next" in intervals(rconn), WATCH)
            spans = intervals(rconn)
            waited = spans["next"][0] - back_at if "next" in spans else None
        if in_maintenance:
            assert rconn.ttl(cleaning) > 0, "negative control: the maintenance lock outlived it"
        if not ours:
            if not RATE_LIMITED:
                time.sleep(WATCH)  # as long as our workers get to record it
            assert waited is None, "plain RQ freed the slot early"
            assert holder.get_status(refresh=True) == JobStatus.STARTED, "left started"
            assert first.poll() is not None or kind == "forking", "the worker quit"
            return
        assert not RATE_LIMITED or (waited is not None and waited <= BOUND), (
            f"waited {waited} s\n{crew.logs()}"
        )
        # Recorded: finished, or failed with LockLost when its renewals failed past the TTL.
        if wait_status(holder, DONE, 10) is JobStatus.FAILED:
            assert "LockLost" in str(holder.latest_result().exc_string), crew.logs()
        assert first.poll() is None, "the worker outlived the outage"
        print(f"\n{kind} worker, Redis restarted under a job: next started {waited} s after")
    finally:
        persistent(server, server.client(), False)


def test_the_parent_heartbeat_during_a_job_takes_rqs_arguments_and_rides_out_an_outage(rconn):
    """``maintain_heartbeats`` is called with rq's own arguments ((job, execution) on rq 3,
    (job) on rq 2); with Redis gone, RQ's raises (and its worker quits), ours does not."""
    queue = Queue("default", connection=rconn)
    job = queue.enqueue(admission_jobs.plain_interval, args=("x", 0.0))
    worker = JoblockWorker([queue], connection=rconn)
    worker.register_birth()
    wanted = list(inspect.signature(Worker.maintain_heartbeats).parameters)[1:]
    execution = worker.prepare_execution(job)  # (rq 2 keeps it as worker.execution)
    args = [job] if wanted == ["job"] else [job, execution]
    job.started_at = datetime.now(UTC)
    worker.maintain_heartbeats(*args)
    assert rconn.ttl(worker.key) > 0, "the heartbeat was written"
    worker.connection = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    with pytest.raises(redis.exceptions.ConnectionError):
        Worker.maintain_heartbeats(worker, *args)  # negative control: RQ's own
    worker.maintain_heartbeats(*args)  # ridden out
    worker.connection = rconn
    worker.register_death()


def test_a_maintenance_lock_left_by_a_dead_pass_is_released(crews, rconn):
    """A worker that died (or lost Redis) during RQ's maintenance leaves RQ's maintenance lock
    for 899 s: no worker cleans the registries meanwhile (jobs a Redis restart left in RQ's
    intermediate queue wait for it). Ours release one older than 60 s; a fresh one stays."""
    crews(True).start("default")
    queue = Queue("default", connection=rconn)
    # Idle: past its start-up maintenance pass, whose release would delete the lock taken here.
    assert wait_for(lambda: _states(rconn) == ["idle"], 30)
    key = queue.registry_cleaning_key
    rconn.delete(key)
    assert queue.acquire_maintenance_lock()
    time.sleep(3 * liveness.INTERVAL)
    assert rconn.ttl(key) > 0, "negative control: a pass under way keeps its lock"
    rconn.expire(key, 899 - 61)  # taken 61 s ago
    assert wait_for(lambda: not rconn.exists(key), 5), "the stale lock is released"


@slots
@pytest.mark.parametrize("kill", ["stop command", "horse SIGKILL"])
@pytest.mark.parametrize("ours", [True, False], ids=["joblock_worker", "negative control: rq"])
def test_a_killed_horses_lock_is_released_at_once(ours, kill, crews, rconn):
    """RQ's stop-job command (django-rq's admin "Stop"), or a SIGKILL (the OOM killer), ends the
    horse of a job holding a 30 s lock. Our worker releases the lock the exited horse held, so
    the next job of the resource starts at once. RQ's own worker frees the admission slot at
    once too, but the next job then waits out the dead horse's lock TTL (the negative control:
    the same fault on plain RQ with RateLimit, a lock in the job)."""
    crew = crews(ours)
    command = "joblock_worker" if ours else "rqworker"
    crew.start("default", command=command)
    # Labels of this run only: a horse of an earlier test (in a session of its own, out of
    # its crew's reach) must not be taken for this one's.
    held, parked_label = f"holder-{secrets.token_hex(4)}", f"next-{secrets.token_hex(4)}"
    holder = admission_jobs.long_hold.delay(35, held)
    horse = pid_of(rconn, held)
    crew.start("default", command=command)
    parked = admission_jobs.hot.delay(35, parked_label, 0.05)
    assert parked.get_status(refresh=True) == "rate_limited"
    fault_at = time.time()
    if kill == "stop command":
        send_stop_job_command(rconn, holder.id)
    else:
        os.kill(horse, signal.SIGKILL)
    assert wait_for(lambda: exited(horse), 10), "negative control: the horse was killed"
    wait_for(lambda: parked_label in intervals(rconn), WATCH)
    spans = intervals(rconn)
    waited = spans[parked_label][0] - fault_at if parked_label in spans else None
    assert wait_status(holder, DONE | {JobStatus.STOPPED}, 10) != JobStatus.FINISHED
    if not ours:
        assert waited is None, f"the next job started {waited} s after the {kill}, in the TTL"
        # Its horse waits in line for the dead holder's lock, in a session of its own that
        # the crew's stop does not reach: hand it the lock, so it ends inside this test.
        force_release("hot:35", reason="the negative control is over", actor="test")
        assert wait_for(lambda: parked_label in intervals(rconn), 10)
        return
    assert waited is not None and waited <= BOUND, f"waited {waited} s\n{crew.logs()}"
    print(f"\n{kill}: the next job started {waited:.2f} s after it (lock TTL 30 s)")


def test_a_job_stopped_before_its_first_renewal_is_shown_silent(crews, rconn):
    """A job's horse SIGSTOPped before its heartbeat's first renewal (at TTL / 3) showed
    "healthy" until its lock expired: a lock never renewed proved nothing. A @locked_job with
    its heartbeat on renews by TTL / 3, so never renewed past TTL / 2 is a stopped heartbeat."""
    from django_joblock.monitor.active import active_locks
    from django_joblock.monitor.health import HEALTHY, SILENT, lock_health

    crews(True).start("default")
    admission_jobs.long_hold.delay(36, "stopped")  # TTL 30 s: first renewal after 10 s
    horse = pid_of(rconn, "stopped")
    os.kill(horse, signal.SIGSTOP)
    try:

        def health() -> tuple[str, str]:
            found = lock_health(active_locks()).get("hot:36")
            return (found.state.value, found.why) if found else ("", "")

        assert health()[0] == HEALTHY.value, "negative control: young, it proves nothing yet"
        assert int(rconn.hget("joblock:{hot:36}:lock", "renewals") or 0) == 0
        assert wait_for(lambda: health()[0] == SILENT.value, 25), health()
        assert "never renewed" in health()[1] and rconn.exists("joblock:{hot:36}:lock")
    finally:
        os.kill(horse, signal.SIGKILL)


def test_a_worker_releases_only_its_own_runs_lock(crews, rconn):
    """Regression (review): after a job's horse exited, its worker released the job's lock if
    the lock named the job, whoever held it: a retry of the job (RQ re-enqueues a failed job
    with ``Retry`` under the same id), already running on another worker, lost its lock. The
    release now also asks for this worker's name in the lock (the negative control: the worker
    that does run the job releases it)."""
    crews(True).start("default")
    label = f"held-{secrets.token_hex(4)}"
    job = admission_jobs.long_hold.delay(38, label)
    pid_of(rconn, label)  # it holds the lock
    job.refresh()
    queue = Queue("default", connection=rconn)
    other = JoblockWorker([queue], connection=rconn, name=f"other-{secrets.token_hex(4)}")
    other.release_lock_of(job)
    held = lock_info("hot:38")
    assert held is not None and held.job_id == job.id, "another worker released a live run's lock"
    JoblockWorker([queue], connection=rconn, name=job.worker_name).release_lock_of(job)
    assert lock_info("hot:38") is None, "negative control: the job's own worker releases it"
    rconn.set(f"test:go:{label}", 1)

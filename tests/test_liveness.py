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
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from rq import Queue, Worker
from rq.command import send_stop_job_command
from rq.job import Job, JobStatus
from rq.scheduler import RQScheduler

from django_joblock import lock, lock_info
from django_joblock.jobs import admission
from django_joblock.worker import JoblockWorker
from tests import admission_jobs, harness
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


@pytest.mark.slow
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


@pytest.mark.slow
@slots
def test_workers_of_another_queue_server_sweeping_never_delay_this_servers_sweep(crews, rconn):
    """Review bug: the sweep's turn (one ``SET NX PX`` per interval) was one for every worker
    sharing the locks' Redis. A worker whose queues live on another Redis (here: another
    database) frees only its own server's slots, yet took the turn: with its workers idle and
    sweeping, this server's idle worker rarely got one, and the job parked behind a dead holder
    waited for RQ's own clean-up (>= 60 s) instead of the holder's TTL + 5 s."""
    scene = Scene(crews(True), rconn, ours=True, resource=37)
    main = harness.redis_url().rsplit("/", 1)[0]
    other_server = redis.Redis.from_url(f"{main}/3")  # another queue namespace, same locks
    sweeping = JoblockWorker([Queue("default", connection=other_server)], connection=other_server)
    sweeps = 0
    done = threading.Event()

    def sweep_all_the_time() -> None:  # as many idle workers of that server would
        nonlocal sweeps
        while not done.is_set():
            sweeping.sweep()
            sweeps += 1
            time.sleep(0.01)

    hog = threading.Thread(target=sweep_all_the_time, daemon=True)
    hog.start()
    try:
        fault_at = time.time()
        _kill_worker(scene)
        waited = scene.started_after(fault_at, WATCH)
    finally:
        done.set()
        hog.join()
    assert sweeps > 100, "negative control: the other server's worker kept sweeping"
    assert waited is not None and waited <= BOUND, (
        f"the parked job started {waited} s after the fault (bound {BOUND} s)\n" + scene.crew.logs()
    )
    assert wait_status(scene.parked, DONE, 10) is JobStatus.FINISHED


@pytest.mark.slow
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


SCHEDULER_LOCK_TTL = 61  # RQ's scheduler lock: its interval (1 s) + 60 s, renewed every second
MAINTENANCE = 5  # the workers' maintenance interval in the test (joblock_worker's default: 60)


@pytest.mark.slow  # RQ's scheduler lock lives 61 s
def test_a_dead_scheduler_is_taken_over_only_once_its_lock_expired(crews, rconn):
    """A job waits in a backoff (RQ's scheduled registry) when the worker running RQ's
    scheduler dies with it. Another worker with ``--with-scheduler`` takes the scheduler over
    with RQ's own maintenance pass, once the dead scheduler's lock expired (RQ's 61 s): not
    earlier, since a scheduler that stopped renewing may only be paused, and would enqueue the
    jobs it had read a second time (tests/test_pauses.py). Bound: the lock's 61 s + the
    maintenance interval."""
    crew = crews(True)
    crew.extra_args = [f"--maintenance-interval={MAINTENANCE}"]
    first = crew.start("default", scheduler=True)
    assert wait_for(lambda: _scheduler_owner(rconn), 30), crew.logs()
    dead_owner = _scheduler_owner(rconn)
    crew.start("default", scheduler=True)
    queue = Queue("default", connection=rconn)
    with lock("hot:33", ttl=30):  # busy outside admission: the job requeues with a backoff
        job = admission_jobs.hot_outside.delay(33, "next", 0.05)
        assert wait_for(lambda: job.id in queue.scheduled_job_registry, 20), crew.logs()
    os.killpg(first.pid, signal.SIGKILL)  # the worker and its scheduler process
    fault_at = time.time()
    assert wait_for(lambda: exited(first.pid), 10)
    # The lease is respected: well past the job's due time, the dead scheduler's lock stands.
    time.sleep(SCHEDULER_LOCK_TTL - 10)
    assert _scheduler_owner(rconn) == dead_owner, "taken over before the lock expired"
    assert "next" not in intervals(rconn), "negative control: nothing enqueued the due job"
    bound = SCHEDULER_LOCK_TTL + MAINTENANCE + 5
    assert wait_for(lambda: "next" in intervals(rconn), fault_at + bound - time.time()), crew.logs()
    waited = intervals(rconn)["next"][0] - fault_at
    assert _scheduler_owner(rconn) not in (None, dead_owner), "another worker took it over"
    print(f"\nscheduler's worker killed: the requeued job started {waited:.2f} s after it")


def _states(rconn: Any) -> list[str]:
    return sorted(worker.get_state() for worker in Worker.all(connection=rconn))


KINDS = [
    "forking",
    "simple",
    "forking, in RQ's maintenance",
    "negative control: rq",
    "negative control: rq, in RQ's maintenance",
]


def _holder_and_parked_job(
    crew: Workers, rconn: Any, queue: Queue, ours: bool, simple: bool
) -> tuple[subprocess.Popen[str], Job]:
    """Start two workers (ours or plain RQ's), then the holder (2 s asleep on resource 34) and,
    where RQ has ``RateLimit``, a job parked behind it; returns the worker running the holder
    and the holder. The holder starts once both workers run: its 2 s are not spent waiting for
    the second worker to start (on a busy machine it ended before the fault)."""
    command = "joblock_worker" if ours else "rqworker"
    workers = [crew.start("default", command=command, simple=simple) for _ in range(2)]
    assert wait_for(lambda: len(Worker.all(connection=rconn)) == 2, 30), crew.logs()
    # rq 2.x: no RateLimit, nothing parks; the job's end must still be recorded.
    limited = {"rate_limit": admission.RateLimit("plain:34", 1)} if RATE_LIMITED else {}
    if ours:
        holder = admission_jobs.hot_sleep.delay(34, "holder", 2.0)
    else:
        holder = queue.enqueue(admission_jobs.plain_sleep, args=("holder", 2.0), **limited)
    ran_in = pid_of(rconn, "holder")  # the worker itself, or its work horse
    first = next(each for each in workers if each.pid in (ran_in, _parent_of(ran_in)))
    if RATE_LIMITED and ours:
        parked = admission_jobs.hot.delay(34, "next", 0.05)
    elif RATE_LIMITED:
        parked = queue.enqueue(admission_jobs.plain_interval, args=("next", 0.05), **limited)
    if RATE_LIMITED:
        assert parked.get_status(refresh=True) == "rate_limited"
    return first, holder


def _parent_of(pid: int) -> int:
    """The parent pid of a running process (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def _restart_redis_while_the_holder_runs(server: Any) -> float:
    """Kill the Redis server for 3 s, long enough for the holder's body to end during the
    outage, and start it again; returns when it was back."""
    server.kill()
    time.sleep(3.0)  # the holder's body ends meanwhile
    server.start()
    return time.time()


def _parked_job_waited(rconn: Any, back_at: float) -> float | None:
    """Seconds from Redis being back to the parked job's start, None if it did not start
    within ``WATCH`` (or nothing parked: rq 2.x)."""
    if not RATE_LIMITED:
        return None
    wait_for(lambda: "next" in intervals(rconn), WATCH)
    spans = intervals(rconn)
    return spans["next"][0] - back_at if "next" in spans else None


def _assert_plain_rq_left_it_started(
    kind: str, first: subprocess.Popen[str], holder: Job, waited: float | None
) -> None:
    """Negative control: plain RQ kept the slot taken and the holder "started", and its
    worker quit (unless it is a forking one)."""
    if not RATE_LIMITED:
        time.sleep(WATCH)  # as long as our workers get to record it
    assert waited is None, "plain RQ freed the slot early"
    assert holder.get_status(refresh=True) == JobStatus.STARTED, "left started"
    assert first.poll() is not None or kind == "forking", "the worker quit"


def _assert_ours_recorded_it(
    crew: Workers, first: subprocess.Popen[str], holder: Job, waited: float | None
) -> None:
    """Ours: the parked job started within the bound, the holder's end was recorded, and the
    worker outlived the outage."""
    assert not RATE_LIMITED or (waited is not None and waited <= BOUND), (
        f"waited {waited} s\n{crew.logs()}"
    )
    # Recorded: finished, or failed with LockLost when its renewals failed past the TTL.
    if wait_status(holder, DONE, 10) is JobStatus.FAILED:
        assert "LockLost" in str(holder.latest_result().exc_string), crew.logs()
    assert first.poll() is None, "the worker outlived the outage"


@pytest.mark.slow
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
        queue = Queue("default", connection=rconn)
        first, holder = _holder_and_parked_job(crew, rconn, queue, ours, simple=kind == "simple")
        cleaning = queue.registry_cleaning_key
        if in_maintenance:  # past the workers' start-up passes: the pass under way is this one
            assert wait_for(lambda: _states(rconn) == ["busy", "idle"], 30), _states(rconn)
            assert queue.acquire_maintenance_lock()
        back_at = _restart_redis_while_the_holder_runs(server)
        waited = _parked_job_waited(rconn, back_at)
        if in_maintenance:
            assert rconn.ttl(cleaning) > 0, "negative control: the maintenance lock outlived it"
        if not ours:
            _assert_plain_rq_left_it_started(kind, first, holder, waited)
            return
        _assert_ours_recorded_it(crew, first, holder, waited)
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


@pytest.mark.slow
@slots
@pytest.mark.parametrize("kill", ["stop command", "horse SIGKILL"])
@pytest.mark.parametrize("ours", [True, False], ids=["joblock_worker", "negative control: rq"])
def test_a_killed_horses_lock_is_released_at_once(ours, kill, crews, rconn):
    """RQ's stop-job command (django-rq's admin "Stop"), or a SIGKILL (the OOM killer), ends the
    horse of a job holding a 30 s lock. Our worker releases the lock the exited horse held before
    RQ frees the admission slot, so the next job of the resource starts at once and finds the
    lock free (no requeue). RQ's own worker frees the admission slot at once too, but the next
    job then finds the dead horse's lock and requeues until its TTL ran out (the negative
    control: the same fault on plain RQ with RateLimit, a lock in the job)."""
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
        assert parked.get_meta(refresh=True)["joblock"]["outcome"] == "requeued"
        return
    assert waited is not None and waited <= BOUND, f"waited {waited} s\n{crew.logs()}"
    assert parked.get_meta(refresh=True)["joblock"].get("requeues", 0) == 0, "found it free"
    print(f"\n{kill}: the next job started {waited:.2f} s after it (lock TTL 30 s)")


@pytest.mark.slow
def test_a_job_stopped_before_its_first_renewal_is_shown_silent(crews, rconn):
    """A job's horse SIGSTOPped before its heartbeat's first renewal (at TTL / 3) showed
    "healthy" until its lock expired: a lock never renewed proved nothing. A @locked_job with
    its heartbeat on renews by TTL / 3, so never renewed past TTL / 2 is a stopped heartbeat."""
    from django_joblock.monitor.active import active_locks
    from django_joblock.monitor.health import Health, holder_health

    crews(True).start("default")
    admission_jobs.long_hold.delay(36, "stopped")  # TTL 30 s: first renewal after 10 s
    horse = pid_of(rconn, "stopped")
    os.kill(horse, signal.SIGSTOP)
    try:

        def health() -> tuple[str, str]:
            rows = active_locks()
            judged = zip(rows, holder_health(rows), strict=True)
            found = [each for row, each in judged if row.resource == "hot:36"]
            return (found[0].state.value, found[0].why) if found else ("", "")

        assert health()[0] == Health.HEALTHY.value, "negative control: young, it proves nothing yet"
        assert int(rconn.hget("joblock:{hot:36}:lock", "renewals") or 0) == 0
        assert wait_for(lambda: health()[0] == Health.SILENT.value, 25), health()
        assert "never renewed" in health()[1] and rconn.exists("joblock:{hot:36}:lock")
    finally:
        os.kill(horse, signal.SIGKILL)


@pytest.mark.slow
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

"""RQ workers (docs/jobs.md, "Workers and database connections" and "When the slot frees").

``JoblockWorker`` closes Django's database connections before each fork, ``JoblockSimpleWorker``
drops stale ones around each job. Both run RQ's maintenance every ``MAINTENANCE_INTERVAL`` s and,
while idle, sweep once per liveness interval (:meth:`~_Loop.sweep`: slots of dead holders, stale
maintenance locks, a dead scheduler, jobs whose end a failover forgot). They ride out a Redis
outage: between jobs, where RQ quits, they log a warning and go on to the dequeue, which waits
with backoff; during a job, the forking worker's parent keeps watching its horse, and the job's
end is recorded once Redis answers again (waiting up to ``OUTAGE_WAIT`` s). Each override of
RQ's worker exists because a test under tests/ fails without it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import redis
from django.db import connections
from rq import SimpleWorker, Worker
from rq.defaults import DEFAULT_MAINTENANCE_TASK_INTERVAL
from rq.exceptions import NoSuchJobError
from rq.scheduler import RQScheduler
from rq.scripts import release_lock

from . import outbox
from .backend import REDIS_ERRORS, text
from .jobs import liveness
from .logs import logger

MAINTENANCE_INTERVAL = 60
SCHEDULER_STALE = 4  # seconds without a renewal of its lock after which a scheduler is dead
MAINTENANCE_LOCK_TTL = 899  # RQ's (Queue.acquire_maintenance_lock)
MAINTENANCE_STALE = 60  # seconds after which a maintenance pass is taken for dead
# Longest wait for Redis before recording a job's end: below RQ's 60 s of slack after a job's
# last heartbeat, after which RQ's maintenance may retry the job while it is recorded here.
OUTAGE_WAIT = 45
OUTAGE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class _Loop:
    """RQ's worker loop with maintenance on time and Redis outages between jobs ridden out."""

    maintenance_interval: int
    name: str
    connection: Any
    exponential_backoff_factor: float
    max_connection_wait_time: float
    scheduler: RQScheduler | None
    birth_date: datetime | None
    executions_key: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # RQ's CLI (`rq worker --worker-class ...`) passes RQ's 600 s default explicitly: an
        # interval of exactly RQ's default is taken as not chosen.
        interval = kwargs.get("maintenance_interval", DEFAULT_MAINTENANCE_TASK_INTERVAL)
        if interval == DEFAULT_MAINTENANCE_TASK_INTERVAL:
            kwargs["maintenance_interval"] = MAINTENANCE_INTERVAL
        super().__init__(*args, **kwargs)
        self._liveness_due = 0.0  # monotonic time of the next sweep
        self._burst = False

    def work(self, *args: Any, **kwargs: Any) -> bool:
        self._burst = bool(kwargs.get("burst", args[0] if args else False))
        return super().work(*args, **kwargs)  # type: ignore[misc, no-any-return]

    @property
    def dequeue_timeout(self) -> int:
        # Back in the loop every liveness interval: the heartbeat below sweeps.
        default: int = super().dequeue_timeout  # type: ignore[misc]
        return max(1, min(default, int(self.maintenance_interval), int(liveness.INTERVAL)))

    @contextlib.contextmanager
    def _outage(self, step: str) -> Iterator[None]:
        try:
            yield
        except OUTAGE as exc:
            message = "worker %s: Redis unavailable in its %s (%s); going on without it"
            logger.warning(message, self.name, step, exc)

    def handle_execution_ended(self, job: Any, queue: Any, heartbeat_ttl: int) -> None:
        """RQ's (the job's last heartbeat, its first write once the job has run), waiting up to
        :data:`OUTAGE_WAIT` s for Redis: an outage when a job ends delays its outcome instead of
        losing it (RQ would record a success as a failure, or nothing, and quit). The write is
        repeated as it is: it sets the same fields again."""
        deadline, pause = time.monotonic() + OUTAGE_WAIT, 0.25
        while True:
            try:
                return super().handle_execution_ended(job, queue, heartbeat_ttl)  # type: ignore[misc, no-any-return]
            except OUTAGE as exc:
                if time.monotonic() >= deadline:
                    raise  # as RQ's own would
                if pause == 0.25:
                    message = "worker %s: Redis unavailable (%s); waiting up to %ss for it"
                    logger.warning(message, self.name, exc, OUTAGE_WAIT)
                time.sleep(pause)
                pause = min(pause * 2, 2.0)

    def maintain_heartbeats(self, *args: Any) -> None:  # (job, execution) on rq 3, (job) on rq 2
        # The forking worker's parent while its horse runs: RQ quits on a Redis error here and
        # orphans the horse; the execution's heartbeat TTL (>= 60 s) covers a short outage.
        with self._outage("heartbeat during a job"):
            super().maintain_heartbeats(*args)  # type: ignore[misc]

    def set_state(self, state: Any, pipeline: Any = None) -> None:
        with self._outage("state") if pipeline is None else contextlib.nullcontext():
            super().set_state(state, pipeline)  # type: ignore[misc]

    def dequeue_job_and_maintain_ttl(self, *args: Any, **kwargs: Any) -> Any:
        # RQ's loop inside waits out connection errors: one escaping came from the state before.
        # SIGTERM while idle interrupts the blocking read (StopRequested); redis-py leaves a
        # Sentinel-managed connection open with its late reply, which RQ's next command reads.
        wait = 1.0
        while True:
            try:
                with self._outage(f"dequeue (retrying in {wait:g} s)"):
                    return super().dequeue_job_and_maintain_ttl(*args, **kwargs)  # type: ignore[misc]
            except BaseException:
                self.connection.connection_pool.disconnect(inuse_connections=False)
                raise
            time.sleep(wait)
            wait = min(wait * self.exponential_backoff_factor, self.max_connection_wait_time)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's heartbeat; called by RQ's dequeue loop (without a pipeline) once per dequeue
        timeout, it also runs :meth:`sweep` once per liveness interval."""
        # On the caller's pipeline nothing is sent here: no outage to ride out.
        with self._outage("heartbeat") if pipeline is None else contextlib.nullcontext():
            super().heartbeat(timeout, pipeline)  # type: ignore[misc]
        if pipeline is None and time.monotonic() >= self._liveness_due:
            self._liveness_due = time.monotonic() + liveness.INTERVAL
            self.sweep()

    def sweep(self) -> None:
        """:func:`~django_joblock.jobs.liveness.sweep` on this worker's Redis and
        :meth:`free_stale_maintenance` unless another worker swept within the interval, then
        :meth:`take_over_scheduler`; failures are logged."""
        try:
            if liveness.claim_turn():
                liveness.sweep(self.connection)
                self.free_stale_maintenance()
            self.take_over_scheduler()
            self.settle_forgotten()
        except REDIS_ERRORS as exc:
            message = "worker %s: liveness sweep failed (%s); next one in %gs"
            logger.warning(message, self.name, exc, liveness.INTERVAL)

    def settle_forgotten(self) -> None:
        """Settle the executions that this idle worker's Redis still lists as its own (rq >= 3):
        a failover forgot how they ended (Sentinel replicates asynchronously), and RQ would hand
        each job out again ~60 s past its last heartbeat, the parked jobs of its resource waiting
        meanwhile. The job's lock, if still its own, is released; its started-registry entry is
        expired, and RQ's own cleanup settles it as abandoned at once (retried under its
        ``Retry``, else failed) and frees its admission slot."""
        if getattr(self, "executions", True) or self.birth_date is None:  # busy, or rq 2
            return
        for execution in self.get_current_executions(refresh=True):  # type: ignore[attr-defined]
            if execution.created_at < self.birth_date:
                continue  # an earlier worker's of this name: RQ's maintenance settles it
            try:
                job = execution.job
            except NoSuchJobError:
                self.connection.srem(self.executions_key, execution.composite_key)
                continue
            message = "worker %s: Redis forgot how job %s ended (a failover?): settled as abandoned"
            logger.warning(message, self.name, job.id)
            self.release_lock_of(job)  # first: a retry of the job may take the lock again
            registry = job.started_job_registry
            with self.connection.pipeline() as pipe:
                registry.add_execution(execution, pipe, ttl=0, xx=True)
                pipe.srem(self.executions_key, execution.composite_key)
                pipe.execute()
            registry.cleanup()

    def release_lock_of(self, job: Any) -> None:
        """:func:`~django_joblock.jobs.liveness.release_ended` for ``job``, which is not running
        here: the next job of its resource starts now, not after the lock's TTL."""
        state = (job.meta or {}).get("joblock")
        resource = state.get("resource") if isinstance(state, dict) else None
        if isinstance(resource, str) and resource:
            try:
                liveness.release_ended(resource, job.id, self.name)
            except REDIS_ERRORS as exc:  # the lock then expires after its TTL
                logger.warning("worker %s: job %s's lock not checked (%s)", self.name, job.id, exc)

    def check_for_suspension(self, burst: bool) -> None:
        with self._outage("suspension check"):
            super().check_for_suspension(burst)  # type: ignore[misc]

    def execute_job(self, job: Any, queue: Any) -> Any:
        # An outage at RQ's first write for a dequeued job quit the worker (test_worker_command);
        # the job is left to RQ's maintenance, as when the worker quits.
        with self._outage(f"start of job {job.id}"):
            return super().execute_job(job, queue)  # type: ignore[misc]

    def perform_job(self, job: Any, queue: Any, *args: Any) -> Any:
        """RQ's, with the outbox deliveries the job recorded held until RQ has recorded its end
        (lock released, admission slot handed on): see :func:`django_joblock.outbox.after_job`."""
        with outbox.after_job():
            return super().perform_job(job, queue, *args)  # type: ignore[misc]

    def run_maintenance_tasks(self) -> None:
        """RQ's, riding out an outage. A burst worker drops its scheduler (its start-up enqueued
        the due jobs): the pass would start a scheduler process, which the worker's exit then
        waits on, for ever when the SIGTERM reaches it before its own signal handlers."""
        if self._burst:
            self.scheduler = None
        with self._outage("maintenance"):
            super().run_maintenance_tasks()  # type: ignore[misc]

    def unsubscribe(self) -> None:
        """RQ's, within RQ's own 1 s: redis-py 8's ``stop()`` waits for a pubsub thread that, having
        read the UNSUBSCRIBE reply before the stop flag, waits RQ's 60 s (a daemon: left behind)."""
        rq_unsubscribe = threading.Thread(target=super().unsubscribe, daemon=True)  # type: ignore[misc]
        rq_unsubscribe.start()
        rq_unsubscribe.join(1)

    def free_stale_maintenance(self) -> None:
        """Release a queue's RQ maintenance lock held for :data:`MAINTENANCE_STALE` seconds: a
        pass takes well under a second, and one that died (or lost Redis) leaves it for RQ's 899 s
        while jobs a Redis restart left in RQ's intermediate queue wait for that maintenance."""
        queues = self.queues  # type: ignore[attr-defined]
        pipe = self.connection.pipeline(transaction=False)
        for queue in queues:
            pipe.ttl(queue.registry_cleaning_key)
        for queue, ttl in zip(queues, pipe.execute(), strict=True):
            if 0 < ttl < MAINTENANCE_LOCK_TTL - MAINTENANCE_STALE:
                message = "worker %s: RQ's maintenance lock of queue %s is %ss old: released"
                logger.warning(message, self.name, queue.name, MAINTENANCE_LOCK_TTL - ttl)
                queue.release_maintenance_lock()

    def take_over_scheduler(self) -> None:
        """Run RQ's scheduler here when the holder of a queue's scheduler lock stopped renewing
        it for :data:`SCHEDULER_STALE` seconds (a live one renews it every second), not after the
        lock's 61 s and the next maintenance. The stale lock is deleted by its owner's name (RQ's
        compare-and-delete): of two workers taking over, one wins."""
        scheduler = self.scheduler
        if scheduler is None or self._burst:  # a burst worker runs no scheduler process
            return
        names = self.queue_names()  # type: ignore[attr-defined]
        pipe = self.connection.pipeline(transaction=False)
        for name in names:
            pipe.get(RQScheduler.get_locking_key(name))
            pipe.ttl(RQScheduler.get_locking_key(name))
        replies = pipe.execute()
        renewed_to = scheduler.interval + 60  # RQ's lock TTL, set afresh on every renewal
        vacant = False
        for name, owner, ttl in zip(names, replies[::2], replies[1::2], strict=True):
            if owner is None:
                vacant = True
            elif ttl < renewed_to - SCHEDULER_STALE:
                message = "worker %s: the scheduler lock of queue %s was not renewed for %ss: its "
                message += "holder %s is gone; taking over"
                logger.warning(message, self.name, name, renewed_to - ttl, text(owner))
                key = RQScheduler.get_locking_key(name)
                vacant |= bool(release_lock(self.connection, key, text(owner)))
        if vacant:
            scheduler.acquire_locks(auto_start=True)  # type: ignore[no-untyped-call]


class JoblockWorker(_Loop, Worker):
    """The forking RQ worker, closing database connections before each fork."""

    def fork_work_horse(self, job: Any, queue: Any) -> None:
        close_connections(stale_only=False)
        super().fork_work_horse(job, queue)

    def monitor_work_horse(self, job: Any, *args: Any) -> None:
        """RQ's, then the release of a lock the exited horse still held (killed by RQ's stop-job
        command, ``job_timeout`` or the OOM killer): the next job of its resource starts now,
        not after the lock's TTL (:func:`~django_joblock.jobs.liveness.release_ended`)."""
        super().monitor_work_horse(job, *args)
        self.release_lock_of(job)


class JoblockSimpleWorker(_Loop, SimpleWorker):
    """The in-process RQ worker, dropping stale database connections around each job."""

    def execute_job(self, job: Any, queue: Any) -> Any:
        close_connections(stale_only=True)
        try:
            return super().execute_job(job, queue)
        finally:
            close_connections(stale_only=True)


def close_connections(*, stale_only: bool) -> None:
    """Close Django's open database connections (``stale_only``: those past ``CONN_MAX_AGE``,
    with errors or autocommit left off, as Django does around requests), without a query: a
    job that never uses the database never touches it. A connection inside an atomic block is
    left open: it is its caller's transaction (a ``TestCase`` running a burst worker)."""
    for conn in connections.all(initialized_only=True):
        if conn.connection is None or conn.in_atomic_block:
            continue
        expired = conn.close_at is not None and time.monotonic() >= conn.close_at
        odd = conn.errors_occurred or conn.autocommit != conn.settings_dict["AUTOCOMMIT"]
        if not stale_only or expired or odd:
            conn.close()
        else:
            conn.health_check_done = False  # type: ignore[attr-defined]  # checked at next use

"""RQ workers (docs/jobs.md, "Workers and database connections"; docs/architecture.md,
"Recovery" lists every RQ hook overridden here, why, and its contract test).

``JoblockWorker`` closes Django's database connections before each fork, ``JoblockSimpleWorker``
drops stale ones around each job. Both add three things to RQ's loop:

- **Redis outages are ridden out.** Between jobs, where RQ's worker quits, they log a warning
  and go on to the dequeue, which waits with backoff; during a job, the forking worker's parent
  keeps watching its horse, and the job's end is recorded once Redis answers again (waiting up
  to :data:`OUTAGE_WAIT` s).
- **A dead holder's admission slot is freed.** While idle they sweep once per liveness interval
  (:func:`django_joblock.jobs.liveness.sweep`: the slots of jobs whose lock expired without a
  release), and the forking worker releases the lock its killed horse still held before RQ
  hands the slot on. Neither takes over a lease another process may still hold: RQ's
  scheduler and maintenance locks are left to RQ, which takes them only once they expired.
- **Stopping starts nothing.** Once asked to stop (warm or cold), a worker runs no sweep, no
  maintenance and starts no scheduler; a burst worker never starts a scheduler process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import redis
from django.db import connections, router
from rq import SimpleWorker, Worker
from rq.defaults import DEFAULT_MAINTENANCE_TASK_INTERVAL
from rq.exceptions import NoSuchJobError
from rq.utils import current_timestamp

from . import metrics, outbox
from .backend import REDIS_ERRORS, text
from .idempotency import store
from .jobs import liveness
from .logs import logger

MAINTENANCE_INTERVAL = 60
# Longest wait for Redis before recording a job's end: below RQ's 60 s of slack after a job's
# last heartbeat, after which RQ's maintenance may retry the job while it is recorded here.
OUTAGE_WAIT = 45
OUTAGE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class _Loop:
    """RQ's worker loop with outages ridden out, liveness sweeps while idle, and nothing
    started once a stop was asked for (see the module docs)."""

    maintenance_interval: int
    name: str
    key: str
    hostname: str | None
    connection: Any
    exponential_backoff_factor: float
    max_connection_wait_time: float
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
        self.stop_requested = False

    def work(self, *args: Any, **kwargs: Any) -> bool:
        """RQ's loop; remembers ``burst`` (RQ keeps it to itself) for
        :meth:`run_maintenance_tasks`."""
        self._burst = bool(kwargs.get("burst", args[0] if args else False))
        self.stop_requested = False
        return super().work(*args, **kwargs)  # type: ignore[misc, no-any-return]

    def register_birth(self) -> None:
        """RQ's, after ending the registration a killed worker of this name left behind (see
        :meth:`end_dead_namesake`): RQ refuses a name while its key lives, up to ``worker_ttl``
        + 60 s (480 s) after a SIGKILL, and a supervisor restarting a named worker failed until
        then. A namesake that may be alive is still refused, with RQ's ``ValueError``."""
        self.end_dead_namesake()
        super().register_birth()  # type: ignore[misc]

    def end_dead_namesake(self) -> None:
        """Register the death of the worker of this name still registered without one, when its
        process is gone: it ran on this host (same hostname) under a pid that no longer runs,
        or under this process's own pid (a container restarted). Its executions stay in RQ's
        started registry, for RQ's maintenance to settle as abandoned."""
        hostname, pid, death = self.connection.hmget(self.key, ["hostname", "pid", "death"])
        if hostname is None or death is not None or text(hostname) != self.hostname:
            return
        old_pid = int(text(pid)) if pid is not None and text(pid).isdigit() else 0
        if old_pid <= 0 or (old_pid != os.getpid() and _process_runs(old_pid)):
            return
        message = (
            "worker %s: the worker of this name (pid %s) was not stopped (killed?): "
            "its registration is ended"
        )
        logger.warning(message, self.name, old_pid)
        self.register_death()  # type: ignore[attr-defined]

    def handle_warm_shutdown_request(self) -> None:
        """RQ's hook, called by its SIGINT / SIGTERM handler on the first signal (a second one
        is a cold stop: RQ raises ``SystemExit``). From here on nothing new starts."""
        self.stop_requested = True
        super().handle_warm_shutdown_request()  # type: ignore[misc]

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
        deadline = time.monotonic() + OUTAGE_WAIT
        pause = 0.25
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
        timeout, it also runs :meth:`sweep` once per liveness interval, unless stopping."""
        # On the caller's pipeline nothing is sent here: no outage to ride out.
        with self._outage("heartbeat") if pipeline is None else contextlib.nullcontext():
            super().heartbeat(timeout, pipeline)  # type: ignore[misc]
        if pipeline is None and not self.stop_requested and time.monotonic() >= self._liveness_due:
            self._liveness_due = time.monotonic() + liveness.INTERVAL
            self.sweep()

    def sweep(self) -> None:
        """:func:`~django_joblock.jobs.liveness.sweep` on this worker's Redis unless another
        worker swept within the interval, then :meth:`settle_forgotten`; failures are logged."""
        try:
            if liveness.claim_turn(self.connection):
                liveness.sweep(self.connection)
            self.settle_forgotten()
        except REDIS_ERRORS as exc:
            message = "worker %s: liveness sweep failed (%s); next one in %gs"
            logger.warning(message, self.name, exc, liveness.INTERVAL)

    def settle_forgotten(self) -> None:
        """Settle the executions that this idle worker's Redis still lists as its own (rq >= 3):
        a failover forgot how they ended (Sentinel replicates asynchronously), and RQ would hand
        each job out again ~60 s past its last heartbeat, the parked jobs of its resource waiting
        meanwhile. No other process runs them (this worker is idle, and an execution is one
        worker's own), so settling them takes nothing from anyone. One step per execution and
        sweep (:meth:`_settle_step`): RQ's own cleanup settles it as abandoned (retried under its
        ``Retry``, else failed) and frees its slot, within a few sweeps."""
        if getattr(self, "executions", True) or self.birth_date is None:  # busy, or rq 2
            return
        for execution in self.get_current_executions(refresh=True):  # type: ignore[attr-defined]
            if execution.created_at < self.birth_date:
                continue  # an earlier worker's of this name: RQ's maintenance settles it
            self._settle_step(execution)

    def _settle_step(self, execution: Any) -> None:
        """The next step for a forgotten ``execution``, by what Redis holds now:

        1. still live in the started registry: release the job's lock, if still its own, and
           expire the entry at the *next* second. RQ's registry cleanup removes every entry up
           to its cut-off second after handling those it read: an entry expired in the second a
           running cleanup read the registry would be removed unhandled (the job started, in no
           registry, for ever);
        2. expired: RQ's registry cleanup (this worker's, or any other's, settles it);
        3. gone from the registry (settled, by this worker or RQ's maintenance): off this
           worker's execution index.

        An entry expiring within the next second waits for a later sweep.
        """
        try:
            job = execution.job
        except NoSuchJobError:
            self.connection.srem(self.executions_key, execution.composite_key)
            return
        registry = job.started_job_registry
        expires = self.connection.zscore(registry.key, execution.composite_key)
        now = current_timestamp()
        if expires is None:
            self.connection.srem(self.executions_key, execution.composite_key)
        elif expires > now + 1:
            message = "worker %s: Redis forgot how job %s ended (a failover?): settled as abandoned"
            logger.warning(message, self.name, job.id)
            self.release_lock_of(job)  # first: a retry of the job may take the lock again
            with self.connection.pipeline() as pipe:
                registry.add_execution(execution, pipe, ttl=1, xx=True)
                pipe.execute()
        elif expires <= now:
            # Not under RQ's maintenance lock: a Redis restart between taking and giving it back
            # leaves it for 15 minutes, and RQ's maintenance (the intermediate queue's jobs,
            # holding admission slots) with it (the likely cause of 7 jobs a chaos run left).
            registry.cleanup()

    def release_lock_of(self, job: Any) -> None:
        """:func:`~django_joblock.jobs.liveness.release_ended` for ``job``, which is not running
        here: the next job of its resource starts now, not after the lock's TTL."""
        state = (job.meta or {}).get("joblock")
        resource = state.get("resource") if isinstance(state, dict) else None
        limit = state.get("limit", 1) if isinstance(state, dict) else 1
        if isinstance(resource, str) and resource and isinstance(limit, int):
            try:
                liveness.release_ended(resource, job.id, self.name, limit)
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
        """RQ's pass, riding out an outage; none once a stop was asked for. A burst worker runs
        RQ's registry clean-up without RQ's scheduler step, which would start a scheduler process
        in a worker about to exit (its start already enqueued the due jobs). Upstream, RQ's
        ``Worker.run_maintenance_tasks`` would skip that step in burst mode and after a stop."""
        if self.stop_requested:
            return
        with self._outage("maintenance"):
            if not self._burst:
                super().run_maintenance_tasks()  # type: ignore[misc]
                return
            self.clean_registries()  # type: ignore[attr-defined]
            clean_groups = getattr(self, "clean_group_registries", None)  # rq >= 3.0
            if clean_groups is not None:
                clean_groups()
            else:
                from rq.group import Group  # rq 2.x's pass cleans them this way

                Group.clean_registries(connection=self.connection)

    def unsubscribe(self) -> None:
        """RQ's, within RQ's own 1 s: redis-py 8's ``stop()`` waits for a pubsub thread that, having
        read the UNSUBSCRIBE reply before the stop flag, waits RQ's 60 s (a daemon: left behind).
        Upstream, RQ's ``unsubscribe`` would bound ``PubSubWorkerThread.stop()`` as it bounds
        ``join``."""
        rq_unsubscribe = threading.Thread(target=super().unsubscribe, daemon=True)  # type: ignore[misc]
        rq_unsubscribe.start()
        rq_unsubscribe.join(1)


class JoblockWorker(_Loop, Worker):
    """The forking RQ worker, closing database connections before each fork (and building the
    idempotency records' statements, once, before the first)."""

    def fork_work_horse(self, job: Any, queue: Any) -> None:
        close_connections(stale_only=False)
        # The records' statements built here once, not again in every horse (no query).
        store.warm(router.db_for_write(store.record_model()))
        super().fork_work_horse(job, queue)

    def handle_job_failure(self, job: Any, *args: Any, **kwargs: Any) -> None:
        """RQ's; in the parent (its horse exited without recording the job's end: killed by a
        signal, RQ's stop-job command, ``job_timeout`` or the OOM killer) the lock the horse
        still held is released first, then RQ frees the job's admission slot: the next job of
        the resource starts now and finds the lock free, not held until its TTL
        (:func:`~django_joblock.jobs.liveness.release_ended`)."""
        if not self.is_horse:
            self.release_lock_of(job)
        super().handle_job_failure(job, *args, **kwargs)


class JoblockSimpleWorker(_Loop, SimpleWorker):
    """The in-process RQ worker, dropping stale database connections around each job. Its jobs'
    metrics go out once a second at most, in a lock release's round trip when one is due, else
    from its heartbeat (:func:`~django_joblock.metrics.jobs_flush_when_due`), not one flush per
    job: a work horse needs that, this process does not exit after a job."""

    def work(self, *args: Any, **kwargs: Any) -> bool:
        with metrics.jobs_flush_when_due():
            return super().work(*args, **kwargs)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        super().heartbeat(timeout, pipeline)
        if pipeline is None:  # RQ's dequeue loop, idle or between jobs: metrics now due go out
            metrics.flush_due()  # (a Redis error keeps them for the next one)

    def execute_job(self, job: Any, queue: Any) -> Any:
        close_connections(stale_only=True)
        try:
            return super().execute_job(job, queue)
        finally:
            close_connections(stale_only=True)


def _process_runs(pid: int) -> bool:
    """True if process ``pid`` runs on this host (a zombie, already dead, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # gone meanwhile; or no /proc (macOS): the signal reached it
        return not os.path.isdir("/proc")
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def default_job_class() -> str | None:
    """The job class our workers run with unless told otherwise: django-joblock's task job
    class (Django tasks and plain RQ jobs alike) when django-tasks-rq is installed, else RQ's."""
    if importlib.util.find_spec("django_tasks_rq") is None:
        return None
    return "django_joblock.jobs.rq_tasks.Job"


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

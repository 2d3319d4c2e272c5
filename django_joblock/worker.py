"""RQ workers (docs/jobs.md, "Workers and database connections") that keep Django's database
connections safe (``JoblockWorker`` closes them before each fork, ``JoblockSimpleWorker`` drops
stale ones around each job), run RQ's maintenance every ``MAINTENANCE_INTERVAL`` s, free the
admission slot of a job whose lock ended without a release within a second while idle
(:mod:`django_joblock.jobs.liveness`; an idle worker never blocks longer in a dequeue), and
ride out a Redis outage between jobs: where RQ quits (heartbeat, suspension check,
maintenance, state before the dequeue), these log a warning and go on to the dequeue, which
waits with backoff.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import redis
from django.db import close_old_connections, connections
from rq import SimpleWorker, Worker

from .backend import REDIS_ERRORS
from .jobs import liveness
from .logs import logger

MAINTENANCE_INTERVAL = 60


class _Loop:
    """RQ's worker loop with maintenance on time and Redis outages between jobs ridden out."""

    maintenance_interval: int
    name: str
    connection: Any
    exponential_backoff_factor: float
    max_connection_wait_time: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("maintenance_interval", MAINTENANCE_INTERVAL)
        super().__init__(*args, **kwargs)

    @property
    def dequeue_timeout(self) -> int:
        # Back in the loop every liveness interval: the heartbeat below sweeps.
        default: int = super().dequeue_timeout  # type: ignore[misc]
        return max(1, min(default, int(self.maintenance_interval), int(liveness.INTERVAL)))

    @contextlib.contextmanager
    def _outage(self, step: str) -> Iterator[None]:
        try:
            yield
        except redis.exceptions.ConnectionError as exc:
            message = "worker %s: Redis unavailable in its %s (%s); the next dequeue waits for it"
            logger.warning(message, self.name, step, exc)

    def dequeue_job_and_maintain_ttl(self, *args: Any, **kwargs: Any) -> Any:
        # RQ's loop inside waits out connection errors: one escaping came from the state before.
        wait = 1.0
        while True:
            with self._outage(f"dequeue (retrying in {wait:g} s)"):
                return super().dequeue_job_and_maintain_ttl(*args, **kwargs)  # type: ignore[misc]
            time.sleep(wait)
            wait = min(wait * self.exponential_backoff_factor, self.max_connection_wait_time)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's heartbeat; called by RQ's dequeue loop (without a pipeline) once per dequeue
        timeout, it also runs the liveness sweep when it is this worker's turn."""
        # On the caller's pipeline nothing is sent here: no outage to ride out.
        with self._outage("heartbeat") if pipeline is None else contextlib.nullcontext():
            super().heartbeat(timeout, pipeline)  # type: ignore[misc]
        if pipeline is None:
            self.sweep()

    def sweep(self) -> None:
        """The liveness sweep (:func:`django_joblock.jobs.liveness.sweep`) on this worker's
        Redis, if no worker swept within the interval. A failure is logged, never raised."""
        try:
            if liveness.claim_turn():
                liveness.sweep(self.connection)
        except REDIS_ERRORS as exc:
            logger.warning(
                "worker %s: liveness sweep failed (%s); next one in %gs",
                self.name,
                exc,
                liveness.INTERVAL,
            )

    def check_for_suspension(self, burst: bool) -> None:
        with self._outage("suspension check"):
            super().check_for_suspension(burst)  # type: ignore[misc]

    def run_maintenance_tasks(self) -> None:
        with self._outage("maintenance"):
            super().run_maintenance_tasks()  # type: ignore[misc]


class JoblockWorker(_Loop, Worker):
    """The forking RQ worker, closing database connections before each fork."""

    def fork_work_horse(self, job: Any, queue: Any) -> None:
        connections.close_all()
        super().fork_work_horse(job, queue)


class JoblockSimpleWorker(_Loop, SimpleWorker):
    """The in-process RQ worker, dropping stale database connections around each job."""

    def execute_job(self, job: Any, queue: Any) -> Any:
        close_old_connections()
        try:
            return super().execute_job(job, queue)
        finally:
            close_old_connections()

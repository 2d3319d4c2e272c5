"""RQ worker classes that keep Django's database connections safe across jobs, and run RQ's
maintenance on time.

A forked work horse must not reuse the parent's database connections: two processes talking
over one socket corrupt the protocol. ``JoblockWorker`` closes the parent's connections right
before each fork, so both sides open their own. ``JoblockSimpleWorker`` (no fork) drops
connections that are unusable or past ``CONN_MAX_AGE`` around each job, as Django does around
each request.

RQ's maintenance (registry clean-up) is what frees the admission slot of a job whose worker
process died (see :mod:`django_joblock.admission`) and retries the jobs of dead workers. RQ
runs it every ``maintenance_interval`` seconds, but an idle RQ worker only checks between two
blocking dequeue calls, each up to ``worker_ttl - 15`` (405 s by default). These workers
default to a ``maintenance_interval`` of ``MAINTENANCE_INTERVAL`` (60 s; RQ's is 600 s) and
never block in a dequeue for longer than it, so the interval is the real bound.

RQ's worker loop waits out a Redis outage only inside its blocking dequeue loop (it retries
with backoff, 1 s doubling to 60 s). The same connection error one step earlier or later, in
the heartbeat after a job, the ``rq suspend`` check, the registry maintenance or the "idle"
state written before the dequeue loop, makes an RQ worker log "found an unhandled exception,
quitting" and exit: a Redis restart that lands between two jobs stops the worker. Those steps
only refresh the worker's own bookkeeping, so these workers log the error (``django_joblock``
logger, warning) and go on to the dequeue, which waits with RQ's backoff until Redis answers
again. A job whose *own* bookkeeping
(its result, its status) fails because Redis is down is not retried here: RQ's registry
maintenance and the job's ``Retry`` cover it, as for a dead worker.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from django.db import close_old_connections, connections
from rq import SimpleWorker, Worker

MAINTENANCE_INTERVAL = 60

logger = logging.getLogger("django_joblock")


class _OnTimeMaintenance:
    """Default ``maintenance_interval`` of 60 s, and dequeue waits no longer than it."""

    maintenance_interval: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("maintenance_interval", MAINTENANCE_INTERVAL)
        super().__init__(*args, **kwargs)

    @property
    def dequeue_timeout(self) -> int:
        default: int = super().dequeue_timeout  # type: ignore[misc]
        return max(1, min(default, int(self.maintenance_interval)))


class _RidesOutOutages:
    """Connection errors in the steps between jobs leave the waiting to the dequeue (see the
    module docs); the worker never quits over them."""

    name: str
    exponential_backoff_factor: float
    max_connection_wait_time: float

    def dequeue_job_and_maintain_ttl(self, *args: Any, **kwargs: Any) -> Any:
        # RQ's own loop inside catches connection errors; one that escapes came from the
        # state written before that loop
        wait = 1.0
        while True:
            try:
                return super().dequeue_job_and_maintain_ttl(*args, **kwargs)  # type: ignore[misc]
            except redis.exceptions.ConnectionError as exc:
                self._outage(f"dequeue (retrying in {wait:g} s)", exc)
                time.sleep(wait)
                wait = min(wait * self.exponential_backoff_factor, self.max_connection_wait_time)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        if pipeline is not None:  # queued on the caller's pipeline: nothing is sent here
            super().heartbeat(timeout, pipeline)  # type: ignore[misc]
            return
        try:
            super().heartbeat(timeout)  # type: ignore[misc]
        except redis.exceptions.ConnectionError as exc:
            self._outage("heartbeat", exc)

    def check_for_suspension(self, burst: bool) -> None:
        try:
            super().check_for_suspension(burst)  # type: ignore[misc]
        except redis.exceptions.ConnectionError as exc:
            self._outage("suspension check", exc)

    def run_maintenance_tasks(self) -> None:
        try:
            super().run_maintenance_tasks()  # type: ignore[misc]
        except redis.exceptions.ConnectionError as exc:
            self._outage("maintenance", exc)

    def _outage(self, step: str, exc: redis.exceptions.ConnectionError) -> None:
        logger.warning(
            "worker %s: Redis unavailable in its %s (%s); waiting for it in the next dequeue",
            self.name,
            step,
            exc,
        )


class JoblockWorker(_RidesOutOutages, _OnTimeMaintenance, Worker):
    """The forking RQ worker, with database connections closed before each fork; it waits
    out a Redis outage between jobs instead of quitting."""

    def fork_work_horse(self, job: Any, queue: Any) -> None:
        connections.close_all()
        super().fork_work_horse(job, queue)


class JoblockSimpleWorker(_RidesOutOutages, _OnTimeMaintenance, SimpleWorker):
    """The in-process RQ worker, with stale database connections dropped around each job; it
    waits out a Redis outage between jobs instead of quitting."""

    def execute_job(self, job: Any, queue: Any) -> Any:
        close_old_connections()
        try:
            return super().execute_job(job, queue)
        finally:
            close_old_connections()

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
"""

from __future__ import annotations

from typing import Any

from django.db import close_old_connections, connections
from rq import SimpleWorker, Worker

MAINTENANCE_INTERVAL = 60


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


class JoblockWorker(_OnTimeMaintenance, Worker):
    """The forking RQ worker, with database connections closed before each fork."""

    def fork_work_horse(self, job: Any, queue: Any) -> None:
        connections.close_all()
        super().fork_work_horse(job, queue)


class JoblockSimpleWorker(_OnTimeMaintenance, SimpleWorker):
    """The in-process RQ worker, with stale database connections dropped around each job."""

    def execute_job(self, job: Any, queue: Any) -> Any:
        close_old_connections()
        try:
            return super().execute_job(job, queue)
        finally:
            close_old_connections()

"""RQ worker classes that keep Django's database connections safe across jobs.

A forked work horse must not reuse the parent's database connections: two processes talking
over one socket corrupt the protocol. ``JoblockWorker`` closes the parent's connections right
before each fork, so both sides open their own. ``JoblockSimpleWorker`` (no fork) drops
connections that are unusable or past ``CONN_MAX_AGE`` around each job, as Django does around
each request.
"""

from __future__ import annotations

from typing import Any

from django.db import close_old_connections, connections
from rq import SimpleWorker, Worker


class JoblockWorker(Worker):
    """The forking RQ worker, with database connections closed before each fork."""

    def fork_work_horse(self, job: Any, queue: Any) -> None:
        connections.close_all()
        super().fork_work_horse(job, queue)


class JoblockSimpleWorker(SimpleWorker):
    """The in-process RQ worker, with stale database connections dropped around each job."""

    def execute_job(self, job: Any, queue: Any) -> Any:
        close_old_connections()
        try:
            return super().execute_job(job, queue)
        finally:
            close_old_connections()

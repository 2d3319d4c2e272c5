"""Issue 12 items 1 and 2 through real RQ worker processes: a Redis restart between two jobs,
and a worker whose connection pool is capped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from rq.job import JobStatus

from tests import jobs
from tests.workers import Workers, wait_status

pytestmark = pytest.mark.django_db(transaction=True)

DONE = {JobStatus.FINISHED, JobStatus.FAILED}


class CappedWorkers(Workers):
    """Workers on tests.settings_capped: ``max_connections`` on the lock cache's pool."""

    def __init__(self, max_connections: int) -> None:
        super().__init__({})
        self.max_connections = max_connections

    def env(self) -> dict[str, str]:
        env = super().env()
        env["DJANGO_SETTINGS_MODULE"] = "tests.settings_capped"
        env["JOBLOCK_TEST_MAX_CONNECTIONS"] = str(self.max_connections)
        return env


@pytest.fixture
def crew() -> Iterator[Workers]:
    workers = Workers({})
    yield workers
    workers.stop()


def test_a_job_after_a_redis_restart_succeeds_on_its_first_attempt(server, rconn, crew):
    # A SimpleWorker runs every job in one process, so its lock connection outlives the
    # restart (a forking worker's work horse would start with fresh connections).
    crew.start(simple=True)
    before = jobs.hold_resource.delay(1, "before-restart", 0.0)
    assert wait_status(before, DONE, 30) is JobStatus.FINISHED, crew.logs()
    run_id = rconn.info("server")["run_id"]
    server.restart()
    assert server.client().info("server")["run_id"] != run_id, "negative control: restarted"
    after = jobs.hold_resource.delay(1, "after-restart", 0.0)
    assert wait_status(after, DONE, 60) is JobStatus.FINISHED, crew.logs()
    assert after.get_meta(refresh=True).get("joblock", {}).get("outcome") in (None, "ran")
    assert "LockBackendUnavailable" not in crew.logs()
    assert [raw.decode().split(":")[0] for raw in rconn.lrange("test:intervals", 0, -1)] == [
        "after-restart"
    ], "the job body ran (the restart lost the first job's record)"


def test_a_worker_with_a_capped_pool_runs_locked_jobs():
    workers = CappedWorkers(max_connections=2)
    try:
        workers.start(simple=True)
        queued = [jobs.hold_resource.delay(i, f"capped-{i}", 0.0) for i in range(4)]
        for job in queued:
            assert wait_status(job, DONE, 60) is JobStatus.FINISHED, workers.logs()
        assert "Too many connections" not in workers.logs()
    finally:
        workers.stop()

"""Through real RQ worker processes: a Redis restart between two jobs,
a Redis outage while the worker is between jobs, and a worker whose connection pool is
capped."""

from __future__ import annotations

import time

import pytest
from rq.job import JobStatus
from rq.suspension import suspend

from tests import jobs
from tests.workers import DONE, Workers, wait_status

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


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
    assert wait_status(after, DONE, 60, crew) is JobStatus.FINISHED, crew.logs()
    assert after.get_meta(refresh=True).get("joblock", {}).get("outcome") in (None, "ran")
    assert "LockBackendUnavailable" not in crew.logs()
    assert [raw.decode().split(":")[0] for raw in rconn.lrange("test:intervals", 0, -1)] == [
        "after-restart"
    ], "the job body ran (the restart lost the first job's record)"


def _outage_while_suspended(server, crew: Workers, command: str) -> None:
    """A worker suspended with ``rq suspend`` checks the suspension key every second, outside
    RQ's dequeue: a Redis outage of 5 s is sure to fail that check (the restart wipes the key,
    so the worker resumes afterwards)."""
    proc = crew.start(simple=True, command=command)
    before = jobs.hold_resource.delay(1, "before-outage", 0.0)
    assert wait_status(before, DONE, 30, crew) is JobStatus.FINISHED, crew.logs()
    suspend(before.connection)
    # if the worker is blocked in its dequeue already, one more job brings it to the check
    jobs.hold_resource.delay(1, "before-suspension", 0.0)
    deadline = time.monotonic() + 30
    while "suspended" not in crew.logs():
        assert time.monotonic() < deadline and proc.poll() is None, crew.logs()
        time.sleep(0.1)
    server.kill()
    time.sleep(5)
    server.start()


def test_a_joblock_worker_waits_out_a_redis_outage_between_jobs(server, crew):
    _outage_while_suspended(server, crew, "joblock_worker")
    after = jobs.hold_resource.delay(1, "after-outage", 0.0)
    assert wait_status(after, DONE, 60, crew) is JobStatus.FINISHED, crew.logs()
    assert crew.procs[0].poll() is None, crew.logs()
    logs = crew.logs(tail=10**6)
    assert "Redis unavailable in its suspension check" in logs, "the outage was met"
    assert "unhandled exception" not in logs


def test_negative_control_an_rq_worker_quits_on_the_same_outage(server, crew):
    _outage_while_suspended(server, crew, "rqworker")  # --worker-class=rq.SimpleWorker
    deadline = time.monotonic() + 30
    while crew.procs[0].poll() is None:
        assert time.monotonic() < deadline, f"the plain RQ worker survived\n{crew.logs()}"
        time.sleep(0.1)
    assert "found an unhandled exception, quitting" in crew.logs(tail=10**6)


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


HOLDER = """
import sys, time
import django
django.setup()
from django_joblock import lock
held = lock("ext:1", ttl=6)
assert held.acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_holder_outside_rq_that_stops_renewing_is_reported_not_renewing(rconn):
    """A lock taken by a plain process (no RQ job, so no RQ evidence either way): while its
    heartbeat renews it is healthy; SIGSTOPped, its own renewal age gives it away before the
    lock expires; it is never reaped as dead (a paused holder may still believe it holds it)."""
    import io
    import os
    import signal
    import subprocess
    import sys

    from django.core.management import call_command

    from django_joblock.monitor.active import active_locks
    from django_joblock.monitor.health import Health, holder_health
    from tests.harness import ROOT, child_env, wait_for

    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"

        def health() -> str:
            rows = active_locks()
            return holder_health(rows)[0].state.value if rows else ""

        renewed = lambda: int(rconn.hget("joblock:{ext:1}:lock", "renewals") or 0) >= 1  # noqa: E731
        assert wait_for(renewed, 10)
        assert health() == Health.HEALTHY.value, "negative control: a renewing holder is healthy"
        os.kill(proc.pid, signal.SIGSTOP)
        assert wait_for(lambda: health() == Health.SILENT.value, 10), health()
        rows = active_locks()
        assert "its heartbeat stopped" in holder_health(rows)[0].why
        out = io.StringIO()
        call_command("joblock_reap", stdout=out)
        assert rconn.exists("joblock:{ext:1}:lock"), "not reaped: " + out.getvalue()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

"""The alerts that tests/test_observability.py fires in-process, fired here by real RQ worker
processes on real Redis (issue 17, item 3): contention and its spike against a baseline from
jobs that find their resource busy, and Redis errors on acquire from a worker whose lock Redis
(another server than its queue's) is down. Each with a negative control that does not fire."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from rq.job import JobStatus

from django_joblock import alerts, lock, metrics
from tests import harness, jobs
from tests.harness import wait_for
from tests.settings import _cache
from tests.test_topologies import TopologyWorkers
from tests.workers import Workers, wait_status

pytestmark = pytest.mark.django_db(transaction=True)

DONE = {JobStatus.FINISHED, JobStatus.FAILED}
BACKOFF = {"base": 0.5, "factor": 2, "max": 2}


def _names() -> set[str]:
    return {alert.name for alert in alerts.evaluate()}


@pytest.fixture
def crew(settings) -> Iterator[Workers]:  # type: ignore[no-untyped-def]
    settings.JOBLOCK = {"REQUEUE_BACKOFF": BACKOFF}
    workers = Workers(settings.JOBLOCK)
    yield workers
    workers.stop()


def test_contention_and_its_spike_fire_from_jobs_that_find_their_resource_busy(
    crew, rconn, settings
):
    # The baseline: 2 of 41 acquires of family "res" busy, filed half an hour ago.
    with lock("res:hot", ttl=5):
        for _ in range(2):
            assert not lock("res:hot").acquire()
    for i in range(38):
        with lock(f"res:{i}", ttl=5):
            pass
    metrics.flush_now(at=time.time() - 1800)
    assert not {"contention", "contention_spike"} & _names(), "negative control: quiet now"
    crew.start(scheduler=True)
    crew.start()
    with lock("res:20", ttl=30):  # held while 12 jobs of its resource arrive
        queued = [jobs.hold_requeue_only.delay(20, f"c{i}", 0.0) for i in range(12)]
        assert wait_for(lambda: metrics.totals().total("contended", "res") >= 12, 60), crew.logs()
    for job in queued:
        assert wait_status(job, DONE, 60, crew) is JobStatus.FINISHED
    fired = {alert.name: alert for alert in alerts.evaluate()}
    assert "contention" in fired and "res" in fired["contention"].message, fired
    assert "contention_spike" in fired and fired["contention_spike"].family == "res", fired
    settings.JOBLOCK = {**settings.JOBLOCK, "ALERTS": {"CONTENTION_SPIKE": 1000}}
    assert "contention_spike" not in _names(), "below 1000 x the baseline"


def test_acquire_errors_fire_from_a_worker_whose_lock_redis_is_down(settings):
    lock_server = harness.RedisServer(harness.free_port())
    lock_server.start()
    lock_url, queue_url = lock_server.url(), harness.redis_url()
    settings.CACHES = {**settings.CACHES, "default": _cache(lock_url)}
    settings.RQ_QUEUES = {"default": {"URL": queue_url}, "other": {"URL": queue_url}}
    # A SimpleWorker: the count of a failed acquire waits in its process until Redis is back
    # (a forked horse exits with it: the metrics live on the Redis that was down).
    crew = TopologyWorkers(lock_url, queue_url)
    try:
        crew.start(simple=True)
        before = jobs.hold_resource.delay(30, "before", 0.0)
        assert wait_status(before, DONE, 30, crew) is JobStatus.FINISHED, crew.logs()
        assert "acquire_errors" not in _names(), "negative control: a healthy acquire"
        lock_server.kill()
        during = jobs.hold_resource.delay(30, "during", 0.0)
        assert wait_status(during, DONE, 30, crew) is JobStatus.FAILED, crew.logs()
        assert "LockBackendUnavailable" in during.latest_result().exc_string
        lock_server.start()
        after = jobs.hold_resource.delay(30, "after", 0.0)  # its run flushes the count too
        assert wait_status(after, DONE, 30, crew) is JobStatus.FINISHED, crew.logs()
        fired = {alert.name: alert for alert in alerts.evaluate()}
        assert "acquire_errors" in fired, fired
        assert fired["acquire_errors"].value == 1 and "res 1" in fired["acquire_errors"].message
    finally:
        crew.stop()
        lock_server.stop()

"""The alerts that tests/test_observability.py fires in-process, fired here by real RQ worker
processes on real Redis: contention and its spike against a baseline from
jobs that find their resource busy, and Redis errors on acquire from a worker whose lock Redis
(another server than its queue's) is down. Each with a negative control that does not fire."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from rq.job import JobStatus

from django_joblock import lock, metrics
from django_joblock.monitor import alerts
from tests import harness, jobs
from tests.harness import wait_for
from tests.settings import _cache
from tests.test_topologies import TopologyWorkers
from tests.workers import DONE, Workers, wait_status

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _names() -> set[str]:
    return {alert.name for alert in alerts.evaluate()}


def test_contention_and_its_spike_fire_from_jobs_that_find_their_resource_busy(
    crew, rconn, settings
):
    # The baseline: 2 of 41 acquires of family "res" busy, filed half an hour ago. Recorded as
    # the locks record them, all at once: 41 real acquires on a busy machine took over a second,
    # and a release then flushed part of them into the current minute (CI).
    for acquired in [True] * 39 + [False] * 2:
        metrics.record_acquire("res", "", 0.0, acquired=acquired)
    metrics.flush_now(at=time.time() - 1800)
    assert not {"contention", "contention_spike"} & _names(), "negative control: quiet now"
    crew.start(scheduler=True)
    crew.start()
    with lock("res:20", ttl=30):  # held while 12 jobs of its resource arrive
        queued = [jobs.hold_requeue_only.delay(20, f"c{i}", 0.0) for i in range(12)]
        assert wait_for(lambda: metrics.totals().total("contended", "res") >= 30, 60), crew.logs()
    for job in queued:
        assert wait_status(job, DONE, 60, crew) is JobStatus.FINISHED
    fired = {alert.name: alert for alert in alerts.evaluate()}
    assert "contention" in fired and "res" in fired["contention"].message, fired
    assert "contention_spike" in fired and fired["contention_spike"].family == "res", fired
    settings.JOBLOCK = {**settings.JOBLOCK, "ALERTS": {"CONTENTION_SPIKE": 1000}}
    assert "contention_spike" not in _names(), "below 1000 x the baseline"


@pytest.fixture
def split(settings) -> Iterator[tuple[harness.RedisServer, TopologyWorkers]]:  # type: ignore[no-untyped-def]
    """Locks (and metrics) on a redis-server of their own, queues on the test Redis: the lock
    Redis can go down while the workers keep dequeueing."""
    lock_server = harness.RedisServer(harness.free_port())
    lock_server.start()
    lock_url, queue_url = lock_server.url(), harness.redis_url()
    settings.CACHES = {**settings.CACHES, "default": _cache(lock_url)}
    settings.RQ_QUEUES = {"default": {"URL": queue_url}, "other": {"URL": queue_url}}
    crew = TopologyWorkers(lock_url, queue_url)
    yield lock_server, crew
    crew.stop()
    lock_server.stop()


def test_acquire_errors_fire_from_a_worker_whose_lock_redis_is_down(split):
    lock_server, crew = split
    # A SimpleWorker: the count of a failed acquire waits in its process until Redis is back
    # (a forked horse exits with it: the metrics live on the Redis that was down).
    crew.start(simple=True)
    before = jobs.hold_resource.delay(30, "before", 0.0)
    assert wait_status(before, DONE, 30, crew) is JobStatus.FINISHED, crew.logs()
    assert "acquire_errors" not in _names(), "negative control: a healthy acquire"
    lock_server.kill()
    # on_conflict="fail": it fails at once (a requeueing job would be requeued until Redis is
    # back, tests/test_topologies.py)
    during = jobs.hold_or_fail.delay(30, "during", 0.0)
    assert wait_status(during, DONE, 30, crew) is JobStatus.FAILED, crew.logs()
    assert "LockBackendUnavailable" in during.latest_result().exc_string
    lock_server.start()
    after = jobs.hold_resource.delay(30, "after", 0.0)  # the count goes out with its metrics
    assert wait_status(after, DONE, 30, crew) is JobStatus.FINISHED, crew.logs()
    # An in-process worker flushes once the oldest count is a flush interval old.
    assert wait_for(lambda: "acquire_errors" in _names(), 10), crew.logs()
    fired = {alert.name: alert for alert in alerts.evaluate()}
    assert fired["acquire_errors"].value == 1 and "res 1" in fired["acquire_errors"].message


def test_renew_failures_fire_when_the_lock_redis_goes_down_under_a_running_job(split, settings):
    # 3 s down is 4-5 renewals at TTL/3: a threshold of 2 (the default is 5) keeps the test
    # about the alert, not about how many attempts fit in the outage.
    settings.JOBLOCK = {"ALERTS": {"RENEW_FAILURES": 2}}
    lock_server, crew = split
    crew.start(simple=True)
    quick = jobs.hold_resource.delay(31, "quick", 0.0)
    assert wait_status(quick, DONE, 30, crew) is JobStatus.FINISHED, crew.logs()
    assert "renew_failures" not in _names(), "negative control: nothing failed"
    held = jobs.hold_resource.delay(31, "renewing", 5.0)  # TTL 2 s: renewed every 0.67 s
    assert wait_for(lambda: lock_server.client().get("test:pid:renewing"), 20), crew.logs()
    lock_server.kill()
    time.sleep(3)  # renewals fail; the TTL passes
    lock_server.start()
    assert wait_status(held, DONE, 30, crew) is JobStatus.FAILED, crew.logs()
    assert "LockLost" in held.latest_result().exc_string
    after = jobs.hold_resource.delay(31, "after", 0.0)  # the counts go out with its metrics
    assert wait_status(after, DONE, 30, crew) is JobStatus.FINISHED, crew.logs()
    assert wait_for(lambda: {"renew_failures", "locks_lost"} <= _names(), 10), crew.logs()
    fired = {alert.name: alert for alert in alerts.evaluate()}
    assert "renew_failures" in fired and fired["renew_failures"].value >= 2, fired
    assert "locks_lost" in fired, fired


def test_long_hold_fires_for_a_real_workers_lock_held_far_longer_than_usual(
    crew, rconn, monkeypatch
):
    monkeypatch.setattr(alerts, "MIN_HOLD", 1.0)
    crew.start()
    quick = [jobs.hold_resource.delay(40 + i % 4, f"q{i}", 0.0) for i in range(24)]
    for job in quick:  # the family's usual hold time: about nothing
        assert wait_status(job, DONE, 60, crew) is JobStatus.FINISHED
    jobs.hold_resource.delay(49, "hung", 8.0)
    assert wait_for(lambda: rconn.get("test:pid:hung"), 20), crew.logs()
    assert "long_hold" not in _names(), "negative control: not long yet"
    assert wait_for(lambda: "long_hold" in _names(), 6), crew.logs()
    fired = [alert for alert in alerts.evaluate() if alert.name == "long_hold"]
    assert "res:49" in fired[0].message, fired


def test_active_growth_fires_while_real_workers_hold_ever_more_locks(settings):
    settings.JOBLOCK = {"ALERTS": {"ACTIVE_GROWTH": 10}}
    crew = Workers(settings.JOBLOCK)
    try:
        for _ in range(3):
            crew.start()
        first = 0.0
        # A sample with 1, 2 and 3 locks held, spanning 90-100 % of ACTIVE_GROWTH (each
        # evaluation records one; the first must still be inside the period at the last).
        for n in range(1, 4):
            jobs.hold_resource.delay(60 + n, f"grow{n}", 20.0)
            assert wait_for(lambda n=n: _active() == n, 20), crew.logs()
            if n == 3:
                time.sleep(max(0.0, first + 9.6 - time.monotonic()))
                break
            first = first or time.monotonic()
            assert "active_growth" not in _names(), f"negative control: {n} sample(s)"
        fired = [alert for alert in alerts.evaluate() if alert.name == "active_growth"]
        # "from 1", or "from 0" when a slow machine's first evaluation read the index before
        # the first lock's entry was in it (the compatibility run once did): growth either way.
        assert fired and re.search(r"grew from [01] to 3 ", fired[0].message), fired
    finally:
        crew.stop()


def _active() -> int:
    """Active locks by the index, once its stale entries are dropped (a reader verifies each
    entry against its lock hash: the last renewal of a horse killed with the test before may
    have written one after that test's locks were flushed)."""
    from django_joblock.locks import index as active_index
    from django_joblock.monitor import active as monitoring

    monitoring.active_locks()
    return sum(active_index.active_counts().values())

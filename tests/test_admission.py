"""Admission through real RQ worker processes: waiting jobs start as soon as the resource
frees, in FIFO order, and none is lost when a holder dies or Redis restarts.

On rq 2.x (the compatibility run) there is no RateLimit: the same scenarios assert the
documented fallback (every waiter requeues with backoff, none overlaps, none is lost).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from rq import Queue
from rq.job import JobStatus

from django_joblock.jobs import admission
from django_joblock.worker import JoblockSimpleWorker, JoblockWorker
from tests import admission_jobs
from tests.harness import persistent, wait_for
from tests.workers import Workers, exited, intervals, pid_of, wait_status

pytestmark = pytest.mark.django_db(transaction=True)

DONE = {JobStatus.FINISHED, JobStatus.FAILED}
RATE_LIMITED = admission.supported()


@pytest.fixture
def workers(settings) -> Iterator[Workers]:  # type: ignore[no-untyped-def]
    settings.JOBLOCK = {"REQUEUE_BACKOFF": {"base": 1, "factor": 2, "max": 4}}
    crew = Workers(settings.JOBLOCK)
    yield crew
    crew.stop()


def _next_second() -> None:
    """Sleep into the start of the next wall-clock second (RQ scores its waiting set in whole
    seconds, so jobs enqueued now share one score)."""
    time.sleep(1.02 - time.time() % 1)


def _parked(jobs: list[Any]) -> None:
    expected = "rate_limited" if RATE_LIMITED else None
    for job in jobs:
        state = job.get_meta(refresh=True)["joblock"]
        assert state["admission"] == ("rate_limit" if RATE_LIMITED else "requeue_only")
        if expected:
            assert job.get_status(refresh=True) == expected, job.get_status(refresh=True)


def _starts(rconn: Any, labels: list[str]) -> list[str]:
    spans = intervals(rconn)
    return sorted(labels, key=lambda label: spans[label][0])


def _no_overlap(rconn: Any) -> None:
    spans = sorted(intervals(rconn).values())
    for (_s1, e1), (s2, _e2) in itertools.pairwise(spans):
        assert e1 <= s2, f"overlapping critical sections: {spans}"


@pytest.mark.slow
def test_waiters_on_one_resource_start_in_fifo_order(workers, rconn):
    workers.start(scheduler=True)
    workers.start()
    workers.start()
    holder = admission_jobs.hot_hold.delay(1, "holder")
    pid_of(rconn, "holder")
    _next_second()
    labels = [f"w{i}" for i in range(8)]
    waiters = [admission_jobs.hot.delay(1, label, 0.05) for label in labels]
    _parked(waiters)
    rconn.set("test:go:holder", 1)
    for job in [holder, *waiters]:
        assert wait_status(job, DONE, 60) is JobStatus.FINISHED, workers.logs()
    _no_overlap(rconn)
    if not RATE_LIMITED:
        return  # rq 2.x: requeue with backoff, no order promised (docs/jobs.md)
    assert _starts(rconn, labels) == labels, "waiters must start in the order they were enqueued"
    for job in waiters:
        state = job.get_meta(refresh=True)["joblock"]
        # Handed the resource on without a single requeue, and the wait was recorded.
        assert state.get("requeues", 0) == 0, state
        assert state["outcome"] == "ran" and state["waited"] > 0, state


@pytest.mark.slow
def test_negative_control_rq_rate_limit_alone_breaks_ties_by_job_id(workers, rconn):
    """What the FIFO scores fix: RQ scores waiting jobs in whole seconds and pops ties by job
    id (random), so eight jobs enqueued within one second start in a random order."""
    if not RATE_LIMITED:
        assert admission.RateLimit is None  # rq 2.x has no RateLimit to compare with
        return
    workers.start()
    workers.start()
    queue = Queue("default", connection=rconn)
    limit = admission.RateLimit(key="plain:1", concurrency=1)
    holder = queue.enqueue(admission_jobs.plain_hold, args=("holder",), rate_limit=limit)
    pid_of(rconn, "holder")
    _next_second()
    labels = [f"p{i}" for i in range(8)]
    jobs = [
        queue.enqueue(admission_jobs.plain_interval, args=(label, 0.05), rate_limit=limit)
        for label in labels
    ]
    rconn.set("test:go:holder", 1)
    for job in [holder, *jobs]:
        assert wait_status(job, DONE, 60) is JobStatus.FINISHED, workers.logs()
    order = _starts(rconn, labels)
    assert order == sorted(labels, key=lambda label: jobs[labels.index(label)].id)
    assert order != labels, "tie broken by job id (1 in 40320 to be in enqueue order)"


def test_jobs_parked_in_one_second_wait_in_enqueue_order(rconn):
    """RQ scores its waiting set in whole seconds and pops ties by job id: the ids
    ``@locked_job`` gives parked jobs sort by their enqueue time."""
    if not RATE_LIMITED:
        assert admission.RateLimit is None  # rq 2.x: no admission, requeue only
        return
    from rq.rate_limit import RateLimitRegistry

    # On a busy machine 20 enqueues may straddle a second: then try again on another resource.
    for resource in range(2, 7):
        admission_jobs.hot_hold.delay(resource, f"holder{resource}")  # no worker: keeps its slot
        _next_second()
        jobs = [admission_jobs.hot.delay(resource, f"j{i}", 0.05) for i in range(20)]
        _parked(jobs)
        registry = RateLimitRegistry.from_job(jobs[0])
        waiting = rconn.zrange(registry.rate_limited_key, 0, -1, withscores=True)
        if len({score for _, score in waiting}) == 1:
            break
    assert len({score for _, score in waiting}) == 1, "negative control: RQ gave one score"
    assert registry.get_rate_limited_job_ids() == [job.id for job in jobs]


@pytest.mark.slow
def test_waiting_jobs_run_after_the_holder_is_sigkilled(workers, rconn):
    workers.start(scheduler=True)
    workers.start()
    holder = admission_jobs.hot_hold.delay(2, "holder")
    horse = pid_of(rconn, "holder")
    assert horse not in {proc.pid for proc in workers.procs}, "expected a forked work horse"
    waiters = [admission_jobs.hot.delay(2, f"w{i}", 0.05) for i in range(4)]
    _parked(waiters)
    os.kill(horse, signal.SIGKILL)
    killed = time.time()
    assert wait_for(lambda: exited(horse), 10), "negative control: the holder was killed"
    for job in waiters:
        # Bound: the dead holder's lock TTL (2 s), then a requeue delay (<= 4 s here) and the
        # scheduler's poll: well inside 30 s.
        assert wait_status(job, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert wait_status(holder, DONE, 10) is JobStatus.FAILED, "the killed job fails visibly"
    spans = intervals(rconn)
    assert "holder" not in spans, "the holder never finished its body"
    assert all(spans[f"w{i}"][0] >= killed for i in range(4)), spans
    _no_overlap(rconn)


@pytest.mark.slow
def test_waiting_jobs_run_after_a_redis_restart(server, rconn, settings):
    """Every waiting job runs, or fails visibly, within a bound. The jobs caught by the
    restart are RQ's to recover: one a worker popped just as Redis was killed sits in RQ's
    intermediate queue until RQ's maintenance has seen it there for a minute; one whose
    worker lost its bookkeeping stays "started" until its execution expires
    (min(job_timeout, 30) + 60 = 65 s here) and is then failed (AbandonedJobError) or retried by
    the next maintenance (every 5 s here); one whose requeue (rq 2.x: RQ's ``Retry``) RQ was
    recording when Redis went away is failed by RQ with the ``ConnectionError``, as RQ's own
    worker fails it. Every other waiting job runs as soon as the resource frees."""
    settings.JOBLOCK = {"REQUEUE_BACKOFF": {"base": 1, "factor": 2, "max": 4}}
    workers = Workers(settings.JOBLOCK, extra_args=["--maintenance-interval", "5"])
    persistent(server, rconn, True)
    try:
        workers.start(scheduler=True)
        workers.start()
        holder = admission_jobs.hot_hold.delay(4, "holder")
        pid_of(rconn, "holder")
        # job_timeout=5: RQ gives up a job lost with the restart 65 s after its last heartbeat
        waiters = [
            admission_jobs.hot.enqueue_call((4, f"w{i}", 0.05), job_timeout=5) for i in range(4)
        ]
        _parked(waiters)
        run_id = rconn.info("server")["run_id"]
        server.restart()
        assert server.client().info("server")["run_id"] != run_id, "negative control: restarted"
        _parked(waiters)  # still waiting after the restart
        rconn.set("test:go:holder", 1)
        # As a process supervisor does in production: an RQ worker may quit when its Redis
        # goes away under it (rq 2.x does, with its scheduler); start a new one.
        deadline = time.monotonic() + 65 + 2 * 5 + 30
        replaced: set[int] = set()
        while not all(job.get_status(refresh=True) in DONE for job in waiters):
            assert time.monotonic() < deadline, workers.logs()
            for index, proc in enumerate(list(workers.procs)):
                if proc.poll() is not None and index not in replaced:
                    replaced.add(index)
                    workers.start(scheduler=index == 0)
            time.sleep(0.2)
        for job in waiters:
            if job.get_status() == JobStatus.FAILED:  # visibly, by RQ's recovery
                failure = str(job.latest_result().exc_string)
                caught = ("AbandonedJobError", "intermediate")
                retry_cut = "handle_job_retry" in failure and "ConnectionError" in failure
                assert retry_cut or any(word in failure for word in caught), failure
        finished = [job for job in waiters if job.get_status() == JobStatus.FINISHED]
        assert len(finished) >= len(waiters) - 1, "at most the one caught by the restart"
        assert wait_status(holder, DONE, 30) in DONE
        _no_overlap(rconn)
    finally:
        workers.stop()
        persistent(server, server.client(), False)


def test_workers_wake_up_for_the_liveness_sweep_every_second(rconn):
    """Idle workers block in their dequeue call for at most the liveness interval (RQ's own
    worker blocks for up to 405 s whatever its maintenance interval), so a slot left by a dead
    holder is freed within a second of its lock's expiry, and RQ's maintenance runs on time."""
    from django_joblock.jobs import liveness

    queue = Queue("default", connection=rconn)
    for worker_class in (JoblockWorker, JoblockSimpleWorker):
        worker = worker_class([queue], connection=rconn)
        assert worker.maintenance_interval == 60
        assert worker.dequeue_timeout == liveness.INTERVAL == 1
    from rq import Worker

    assert Worker([queue], connection=rconn).dequeue_timeout == 405, "RQ's own default"


@pytest.mark.slow
def test_wait_to_start_is_measured_and_shown(workers, rconn):
    """meta["joblock"]["waited"], the start_wait_seconds histogram, the dashboard card and
    chart, and the Prometheus series."""
    from django_joblock import metrics
    from django_joblock.monitor import dashboard
    from django_joblock.monitor.prometheus import exposition

    workers.start()
    holder = admission_jobs.hot_hold.delay(5, "holder")
    pid_of(rconn, "holder")
    waiter = admission_jobs.hot.delay(5, "waiter", 0.0)
    time.sleep(1.0)
    rconn.set("test:go:holder", 1)
    assert wait_status(waiter, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert wait_status(holder, DONE, 30) is JobStatus.FINISHED
    waited = waiter.get_meta(refresh=True)["joblock"]["waited"]
    assert 1.0 <= waited < 30, waited
    histogram = metrics.totals().merged_histogram("start_wait_seconds", "hot")
    assert sum(histogram) == 2, "one observation per job that started"
    page = dashboard.build()
    cards = dict(page["cards"])
    assert cards["Wait to start p50 / p99 (1 h)"].startswith("≤ "), cards
    chart = next(c for c in page["charts"] if c.title.startswith("Wait from enqueue"))
    assert [bar.label for bar in chart.bars] == ["hot"]
    assert b'joblock_start_wait_seconds_count{family="hot"' in exposition()


def test_how_admission_meets_rqs_own_options(rconn):
    """A caller's rate_limit wins, RQ's unique=True and pipeline= go without admission (RQ
    refuses them with a rate limit), admission=False is off; each is said in the meta."""
    queue = Queue("default", connection=rconn)

    def mode(job: Any) -> str:
        return str(job.get_meta(refresh=True)["joblock"]["admission"])

    off = admission_jobs.hot_outside.delay(20, "off", 0.0)
    assert mode(off) == "off" and not getattr(off, "rate_limit_key", None)
    if not RATE_LIMITED:
        assert mode(admission_jobs.hot.delay(20, "x", 0.0)) == "requeue_only"
        return
    mine = admission.RateLimit(key="tenant:7", concurrency=2)
    job = admission_jobs.hot.enqueue_call((21, "mine", 0.0), rate_limit=mine)
    assert mode(job) == "caller_rate_limit" and job.rate_limit_key == "tenant:7"
    unique = admission_jobs.hot.enqueue_call((22, "u", 0.0), job_id="mine-1", unique=True)
    assert mode(unique) == "rq_unique" and not unique.rate_limit_key
    with rconn.pipeline() as pipe:
        piped = admission_jobs.hot.enqueue_call((23, "p", 0.0), pipeline=pipe)
        pipe.execute()
    assert piped.meta["joblock"]["admission"] == "pipeline" and not piped.rate_limit_key
    parked = admission_jobs.hot.delay(24, "a", 0.0)
    assert mode(parked) == "rate_limit" and parked.rate_limit_key == "joblock:{hot:24}:lock"
    assert queue.count == 5

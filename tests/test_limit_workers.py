"""``@locked_job(concurrency=N)`` on real RQ worker processes: at most N runs of a resource at
once, none lost, parked jobs in order, a dead holder's slot reused, a paused one's write
refused; and the negative control of a counter without TTL, which loses a slot for good.

On rq 2.x (the compatibility run) there is no RateLimit: waiting jobs requeue with backoff,
so the order is not asserted there (docs/jobs.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from rq.job import JobStatus

from django_joblock import lock
from django_joblock.jobs import admission
from tests import admission_jobs, harness
from tests.admission_jobs import HOT_TTL, QUOTA_LIMIT
from tests.harness import wait_for
from tests.testapp.models import Account
from tests.workers import Workers, exited, intervals, pid_of, wait_status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

DONE = {JobStatus.FINISHED, JobStatus.FAILED}
RATE_LIMITED = admission.supported()


@pytest.fixture
def workers(settings) -> Iterator[Workers]:  # type: ignore[no-untyped-def]
    settings.JOBLOCK = {"REQUEUE_BACKOFF": {"base": 1, "factor": 2, "max": 4}}
    crew = Workers(settings.JOBLOCK)
    yield crew
    crew.stop()


def _most_at_once(spans: dict[str, tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end before a start at the same time)."""
    events = sorted(
        [(start, 1) for start, _ in spans.values()] + [(end, -1) for _, end in spans.values()]
    )
    most = running = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def test_eight_workers_never_run_more_than_three_at_once(workers: Workers, rconn: Any) -> None:
    workers.start(scheduler=True)
    for _ in range(7):
        workers.start()
    labels = [f"j{i:02d}" for i in range(24)]
    jobs = [admission_jobs.limited.delay(1, label, 0.3) for label in labels]
    for job in jobs:
        assert wait_status(job, DONE, 120) is JobStatus.FINISHED, workers.logs()
    spans = intervals(rconn)
    assert sorted(spans) == labels, "every job ran once"
    assert _most_at_once(spans) == QUOTA_LIMIT, spans  # three at once, never four
    if not RATE_LIMITED:
        return
    # Parked in RQ and started first come, first served: a job can be overtaken only by one
    # started with it, while the slots it waited for freed.
    started = sorted(labels, key=lambda label: spans[label][0])
    for place, label in enumerate(started):
        assert abs(labels.index(label) - place) < QUOTA_LIMIT, started
    for job in jobs:
        assert job.get_meta(refresh=True)["joblock"].get("requeues", 0) == 0


def test_a_sigkilled_holders_slot_is_reused_within_its_ttl(workers: Workers, rconn: Any) -> None:
    workers.start(scheduler=True)
    for _ in range(3):
        workers.start()
    holders = [admission_jobs.limited_hold.delay(2, f"h{i}") for i in range(QUOTA_LIMIT)]
    horses = [pid_of(rconn, f"h{i}") for i in range(QUOTA_LIMIT)]
    waiter = admission_jobs.limited.delay(2, "next", 0.05)
    time.sleep(1)
    assert waiter.get_status(refresh=True) not in DONE, "negative control: three slots held"
    slot_keys = [f"joblock:{{quota:2}}:lock{suffix}" for suffix in ("", ":1", ":2")]
    slot_of = {int(rconn.hget(key, "pid")): key for key in slot_keys}
    assert sorted(slot_of) == sorted(horses), "each horse holds a slot of its own"
    os.kill(horses[0], signal.SIGKILL)
    killed = time.time()
    assert wait_for(lambda: exited(horses[0]), 10), "negative control: the holder was killed"
    assert wait_status(waiter, DONE, HOT_TTL + 5) is JobStatus.FINISHED, workers.logs()
    assert intervals(rconn)["next"][0] - killed <= HOT_TTL + 5
    for horse in horses[1:]:  # the others' slots were not touched
        assert int(rconn.hget(slot_of[horse], "pid")) == horse
    for i in range(1, QUOTA_LIMIT):
        rconn.set(f"test:go:h{i}", 1)
    for job in holders[1:]:
        assert wait_status(job, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert wait_status(holders[0], DONE, 30) is JobStatus.FAILED


def test_a_sigstopped_holder_resumed_after_its_ttl_commits_nothing(
    workers: Workers, rconn: Any
) -> None:
    workers.start()
    paused = admission_jobs.limited_write.delay(3, "stale")
    horse = pid_of(rconn, "stale")
    os.kill(horse, signal.SIGSTOP)
    try:
        time.sleep(HOT_TTL + 0.5)  # past the TTL: its slot expires on the server
        # Every slot taken by others now, the stale holder's included.
        others = [lock("quota:3", limit=QUOTA_LIMIT, wait=0) for _ in range(QUOTA_LIMIT)]
        assert all(each.acquire() for each in others)
        rconn.set("test:go:stale", 1)  # resume straight into the write
    finally:
        os.kill(horse, signal.SIGCONT)
    assert wait_status(paused, DONE, 30) is JobStatus.FAILED, workers.logs()
    assert "LockLost" in paused.latest_result().exc_string
    assert not Account.objects.filter(name="stale").exists(), "the stale write was committed"
    for each in others:
        each.release()
    # Negative control: the same job, not paused, writes its row.
    fresh = admission_jobs.limited_write.delay(3, "fresh")
    rconn.set("test:go:fresh", 1)
    assert wait_status(fresh, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert Account.objects.filter(name="fresh").exists()


_COUNTER_HOLDER = """
import sys, time, redis
client = redis.Redis.from_url(sys.argv[1])
if client.incr("test:naive:count") > int(sys.argv[2]):
    client.decr("test:naive:count")
    sys.exit(1)
client.set("test:naive:holding", 1)
time.sleep(600)
client.decr("test:naive:count")
"""

_LOCK_HOLDER = """
import os, sys, time
import django
django.setup()
from django_joblock import lock
held = lock("quota:naive", limit=int(sys.argv[2]), ttl=1)
assert held.acquire(wait=0)
import redis
redis.Redis.from_url(sys.argv[1]).set("test:lock:holding", 1)
time.sleep(600)
"""


def _killed_holder(script: str, flag: str, rconn: Any, url: str) -> None:
    """Start a process running ``script`` (it holds one slot, then sets ``flag``) and SIGKILL
    it once it holds."""
    proc = subprocess.Popen([sys.executable, "-c", script, url, str(QUOTA_LIMIT)])
    try:
        assert wait_for(lambda: rconn.exists(flag), 30), "the holder never held"
    finally:
        proc.kill()
        proc.wait(30)


def test_negative_control_a_counter_without_ttl_loses_a_slot_for_good(rconn: Any) -> None:
    redis_url = harness.redis_url()
    # The hand-written counter: a holder that dies never gives its slot back.
    _killed_holder(_COUNTER_HOLDER, "test:naive:holding", rconn, redis_url)
    time.sleep(1 + 5)  # the lock holder's TTL + 5 s: the counter has no TTL to wait for
    taken = 0
    for _ in range(QUOTA_LIMIT):
        if rconn.incr("test:naive:count") <= QUOTA_LIMIT:
            taken += 1
    assert taken == QUOTA_LIMIT - 1, "the dead holder's slot is lost for good"
    # The lock with a limit: the dead holder's slot frees with its TTL (1 s).
    _killed_holder(_LOCK_HOLDER, "test:lock:holding", rconn, redis_url)
    held = [lock("quota:naive", limit=QUOTA_LIMIT, wait=1 + 5) for _ in range(QUOTA_LIMIT)]
    assert all(each.acquire() for each in held), "every slot is usable again"
    for each in held:
        each.release()

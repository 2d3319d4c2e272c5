"""Locks and queues apart: another Redis database, or another Redis server.

A real RQ worker runs with the locks on one Redis and django-rq's queues on another, holds a
lock for several seconds, and meanwhile ``joblock_locks``, ``joblock_reap`` and the admin
dashboard look at it. Its RQ job and worker live on the queue Redis only: reading them on the
lock Redis would call the live holder dead and release its lock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
import redis
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from rq.job import Job, JobStatus

from django_joblock.jobs.queues import get_queue
from django_joblock.models import LockAudit
from tests import harness, seam_jobs
from tests.harness import wait_for
from tests.settings import _cache
from tests.testapp.models import Account
from tests.workers import ROOT, Workers, wait_status

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

DONE = {JobStatus.FINISHED, JobStatus.FAILED}


class TopologyWorkers(Workers):
    """Worker processes running with ``tests.settings_topology`` (locks and queues apart)."""

    def __init__(self, lock_url: str, queue_url: str) -> None:
        super().__init__()
        self.lock_url, self.queue_url = lock_url, queue_url

    def env(self) -> dict[str, str]:
        env = super().env()
        env["DJANGO_SETTINGS_MODULE"] = "tests.settings_topology"
        env["JOBLOCK_TEST_LOCK_URL"] = self.lock_url
        env["JOBLOCK_TEST_QUEUE_URL"] = self.queue_url
        return env


def _apart(settings: Any, lock_url: str, queue_url: str) -> tuple[TopologyWorkers, Any]:
    """This process and its workers with the locks on ``lock_url`` and the queues on
    ``queue_url`` (emptied first): the workers and a client of the queue Redis."""
    queue_client = redis.Redis.from_url(queue_url)
    queue_client.flushdb()
    settings.CACHES = {**settings.CACHES, "default": _cache(lock_url)}
    settings.RQ_QUEUES = {"default": {"URL": queue_url}, "other": {"URL": queue_url}}
    return TopologyWorkers(lock_url, queue_url), queue_client


@pytest.fixture(params=["databases", "servers"])
def topology(request, settings, redis_server) -> Iterator[dict[str, Any]]:  # type: ignore[no-untyped-def]
    """Locks on the test Redis; queues on its database 1, or on a second redis-server."""
    main = harness.redis_url().rsplit("/", 1)[0]
    second = None
    if request.param == "databases":
        lock_url, queue_url = f"{main}/0", f"{main}/1"
    else:
        second = harness.RedisServer(harness.free_port())
        second.start()
        lock_url, queue_url = f"{main}/0", f"redis://127.0.0.1:{second.port}/0"
    crew, queue_client = _apart(settings, lock_url, queue_url)
    yield {
        "crew": crew,
        "lock": redis.Redis.from_url(lock_url),
        "queue": queue_client,
        "name": request.param,
    }
    crew.stop()
    queue_client.flushdb()
    if second is not None:
        second.stop()


def _pid(client: Any, label: str) -> int:
    assert wait_for(lambda: client.get(f"test:pid:{label}"), 30), f"{label} never started"
    return int(client.get(f"test:pid:{label}"))


def _locks(client: Any) -> dict[str, dict[str, Any]]:
    out = StringIO()
    call_command("joblock_locks", "--json", stdout=out)
    return {row["resource"]: row for row in json.loads(out.getvalue())}


def test_live_holder_is_healthy_and_never_reaped_then_a_dead_one_is(topology):
    crew, locks, queues = topology["crew"], topology["lock"], topology["queue"]
    crew.start()
    admin = User.objects.create_superuser("root", password="pw")
    browser = Client()
    browser.force_login(admin)

    live = seam_jobs.hold_until_told.delay(1)
    _pid(locks, "split1")
    # The split is real: RQ's job and worker are on the queue Redis only.
    job_key = Job.key_for(live.id)
    assert queues.exists(job_key) and not locks.exists(job_key)
    assert locks.exists("joblock:{split:1}:lock") and not queues.exists("joblock:{split:1}:lock")
    assert wait_for(lambda: "split:1" in _locks(locks), 10), "the lock never got indexed"
    owner = _locks(locks)["split:1"]["owner"]
    time.sleep(3)  # a few seconds old, not renewed yet (TTL 30 s renews after 10 s)

    page = browser.get("/admin/django_joblock/dashboard/")
    assert page.status_code == 200
    assert b"jl-health-healthy" in page.content and b"holder dead</td>" not in page.content
    out = StringIO()
    call_command("joblock_reap", stdout=out)
    assert "0 lock(s) with a dead holder" in out.getvalue(), out.getvalue()
    assert LockAudit.objects.count() == 0, LockAudit.objects.values("reason", "outcome")
    row = _locks(locks)["split:1"]
    assert (row["health"], row["renewals"], row["owner"]) == ("healthy", 0, owner), row
    assert row["why"] == ""

    locks.set("test:go:split1", 1)
    assert wait_status(live, DONE, 30) is JobStatus.FINISHED, crew.logs()
    assert live.get_meta(refresh=True)["joblock"]["outcome"] == "ran"
    assert LockAudit.objects.count() == 0

    # Negative control: in the same topology a holder that really died is found and reaped.
    # (Our worker releases the lock of a killed @locked_job horse itself; a lock the job took
    # with lock() is left behind.)
    doomed = get_queue("default").enqueue(seam_jobs.hold_lock_in_a_plain_job, 2)
    horse = _pid(locks, "split2")
    assert wait_for(lambda: "split:2" in _locks(locks), 10), "the lock never got indexed"
    os.kill(horse, signal.SIGKILL)
    assert wait_status(doomed, DONE, 30) is JobStatus.FAILED, crew.logs()
    row = _locks(locks)["split:2"]
    assert row["health"] == "holder dead", row
    assert f"RQ job {doomed.id} is failed" in row["why"] and "is gone" in row["why"], row
    out = StringIO()
    call_command("joblock_reap", stdout=out)
    assert "split:2: released" in out.getvalue(), out.getvalue()
    assert not locks.exists("joblock:{split:2}:lock")
    audit = LockAudit.objects.get()
    assert audit.action == "reap" and f"RQ job {doomed.id} is failed" in audit.reason


def test_purge_redis_also_removes_the_app_keys_on_the_queue_redis(topology):
    """``joblock_purge --redis`` (uninstall): a run's entry in its family's history is written
    next to its RQ job, on the queue Redis; it goes too, and RQ's own keys stay."""
    crew, locks, queues = topology["crew"], topology["lock"], topology["queue"]
    crew.start()
    job = seam_jobs.plain_once.delay(5)
    assert wait_status(job, DONE, 30) is JobStatus.FINISHED, crew.logs()
    on_queue = {key.decode() for key in queues.scan_iter(match="joblock:*")}
    # The split is real: these keys are on the queue Redis only.
    assert "joblock:runs:plain" in on_queue, on_queue
    assert not locks.exists("joblock:runs:plain")

    out = StringIO()
    call_command("joblock_purge", "--redis", stdout=out)
    assert "1 runs" in out.getvalue(), out.getvalue()
    assert list(queues.scan_iter(match="joblock:*")) == []
    assert list(locks.scan_iter(match="joblock:*")) == []
    assert queues.exists(Job.key_for(job.id)), "RQ's own keys are not the app's to remove"


def _django(env: dict[str, str], *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_rq_key_prefix_of_rq_3_is_followed(rconn):
    """rq 3 reads ``RQ_KEY_PREFIX`` from the environment: its job and worker keys are then not
    ``rq:...``. Every process here (worker, enqueuer, commands) runs with the same prefix, as a
    deployment does; the test process itself never touches RQ's keys. (rq 2.12 has no such
    setting and uses ``rq:``: the test then checks the default prefix.)"""
    crew = Workers()
    env = dict(crew.env(), RQ_KEY_PREFIX="myrq")
    crew.env = lambda: env  # type: ignore[method-assign]
    try:
        crew.start()
        enqueue = "import django; django.setup()\nfrom tests import seam_jobs\n"
        enqueue += "print(seam_jobs.hold_until_told.delay(5).id)\n"
        job_id = _django(env, "-c", enqueue).strip()
        assert wait_for(lambda: rconn.get("test:pid:split5"), 30), crew.logs()
        assert wait_for(lambda: rconn.zcard("joblock:active:split"), 10)
        # --skip-checks: on SQLite the job's open transaction holds the database's write lock,
        # which Django's JSONField probe would wait 30 s for (PostgreSQL does not mind).
        rows = json.loads(_django(env, "-m", "django", "joblock_locks", "--json", "--skip-checks"))
        assert [(r["resource"], r["job_id"], r["health"]) for r in rows] == [
            ("split:5", job_id, "healthy")
        ], rows
        reaped = _django(env, "-m", "django", "joblock_reap", "--skip-checks")
        assert "0 lock(s) with a dead holder" in reaped
        rconn.set("test:go:split5", 1)
        assert wait_for(lambda: not rconn.exists("joblock:{split:5}:lock"), 30), crew.logs()
        assert LockAudit.objects.count() == 0
    finally:
        crew.stop()


def test_a_short_outage_of_the_lock_redis_requeues_jobs_instead_of_failing_them(settings):
    """Found by a deployment test: a 3 s outage of the lock Redis failed most of a parked
    backlog (each failed job freed its slot, and RQ promoted the next one at once)."""
    lock_server = harness.RedisServer(harness.free_port())
    lock_server.start()
    main = harness.redis_url().rsplit("/", 1)[0]
    lock_url, queue_url = f"redis://127.0.0.1:{lock_server.port}/0", f"{main}/1"
    crew, queues = _apart(settings, lock_url, queue_url)
    try:
        crew.start(scheduler=True)
        lock_server.kill()
        failing = seam_jobs.fail_on_outage.delay(2, "failed")
        backlog = [seam_jobs.run_after_outage.delay(1, f"backlog{i}") for i in range(6)]
        assert wait_status(failing, DONE, 60, crew) is JobStatus.FAILED, crew.logs()
        result = failing.latest_result()
        assert result is not None and "LockBackendUnavailable" in (result.exc_string or ""), (
            "negative control: the lock's Redis is down"
        )
        assert wait_for(lambda: backlog[0].get_meta(refresh=True)["joblock"].get("requeues"), 30)
        assert "did not answer" in backlog[0].get_meta()["joblock"]["reason"]
        time.sleep(3)
        lock_server.restart()
        for job in backlog:
            assert wait_status(job, DONE, 120, crew) is JobStatus.FINISHED, crew.logs()
    finally:
        crew.stop()
        queues.flushdb()
        lock_server.stop()
    ran = sorted(Account.objects.filter(name__startswith="backlog").values_list("name", flat=True))
    assert ran == [f"backlog{i}" for i in range(6)], "every job ran, once"
    assert not Account.objects.filter(name="failed").exists()

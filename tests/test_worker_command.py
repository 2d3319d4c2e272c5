"""``joblock_worker`` takes rqworker's common options (real worker processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import redis
from django.core.management import call_command
from django.core.management.base import CommandError
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue
from rq.defaults import DEFAULT_MAINTENANCE_TASK_INTERVAL
from rq.job import JobStatus

from django_joblock.worker import MAINTENANCE_INTERVAL, JoblockSimpleWorker, JoblockWorker
from tests import jobs
from tests.harness import Proxy, wait_for
from tests.procs.redis_server import free_port
from tests.workers import ROOT, Workers, wait_status

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--worker-class", "no.such.Worker"], "cannot be imported"),
        (["--worker-class", "django_joblock.conf.Range"], "not an RQ worker class"),
        (["--worker-class", "rq.SimpleWorker", "--simple"], "exclude each other"),
        (["--max-idle-time", "0"], "--max-idle-time must be >= 1"),
        (["--worker-ttl", "-5"], "--worker-ttl must be >= 1"),
        # Redis refused the worker key's EXPIRE: a ResponseError traceback before
        (["--worker-ttl", "99999999999999999999"], "--worker-ttl must be <= 1000000000"),
    ],
)
def test_bad_worker_options_are_named(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("joblock_worker", "default", *args)


def test_a_pid_file_that_cannot_be_written_is_named(tmp_path):
    where = tmp_path / "no-such-dir" / "worker.pid"
    with pytest.raises(CommandError, match=r"--pid .*no-such-dir.*cannot write the pid file"):
        call_command("joblock_worker", "default", "--burst", "--pid", str(where))


@pytest.mark.parametrize("command", ["joblock_purge", "joblock_outbox"])
def test_an_unknown_database_alias_is_named(command):
    with pytest.raises(CommandError, match=r"--database: invalid choice: 'nope'"):
        call_command(command, "--database", "nope")


@pytest.mark.slow
def test_rqworker_options_run_a_real_worker(tmp_path, rconn):
    crew = Workers()
    try:
        job = jobs.hold_resource.delay(5, "opts", 0.0)
        pid_file = tmp_path / "worker.pid"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "django",
                "joblock_worker",
                "default",
                "--burst",
                "--worker-class",
                "django_joblock.worker.JoblockSimpleWorker",
                "--worker-ttl",
                "30",
                "--max-idle-time",
                "5",
                "--max-jobs",
                "1",
                "--name",
                "opts-worker",
                "--pid",
                str(pid_file),
            ],
            cwd=ROOT,
            env=crew.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert wait_status(job, {JobStatus.FINISHED, JobStatus.FAILED}, 5) is JobStatus.FINISHED
        assert job.get_meta(refresh=True)["joblock"]["outcome"] == "ran"
        assert "Worker opts-worker" in done.stdout + done.stderr  # --name reached RQ
        assert int(pid_file.read_text()) > 0
        assert "does not derive" not in done.stderr
        # A worker class of RQ's own runs too, with a warning about database connections.
        second = jobs.hold_resource.delay(6, "plain-class", 0.0)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "django",
                "joblock_worker",
                "default",
                "--burst",
                "--worker-class",
                "rq.SimpleWorker",
            ],
            cwd=ROOT,
            env=crew.env(),
            capture_output=True,
            text=True,
            timeout=180,  # RQ's own worker may wait 60 s for its pubsub thread at exit
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "does not derive from django_joblock.worker.JoblockWorker" in done.stderr
        assert second.get_status(refresh=True) is JobStatus.FINISHED
    finally:
        crew.stop()


def test_a_worker_started_while_redis_is_down_says_so_in_one_line(settings):
    """It printed RQ's 62-line traceback (a supervisor restarting it logs that each time)."""
    from tests import harness

    settings.RQ_QUEUES = {"default": {"URL": harness.dead_url()}}
    with pytest.raises(CommandError, match=r"Redis does not answer \(.*127\.0\.0\.1") as caught:
        call_command("joblock_worker", "default", "--burst")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("worker_class", [JoblockWorker, JoblockSimpleWorker])
def test_rqs_cli_default_maintenance_interval_gives_way_to_ours(worker_class, rconn):
    """RQ's CLI passes its 600 s default explicitly (`rq worker --worker-class ...`): it used
    to override our 60 s silently. Another explicit interval stays."""
    queue = Queue("default", connection=rconn)
    cli = rq_cli_worker_kwargs()
    assert cli["maintenance_interval"] == DEFAULT_MAINTENANCE_TASK_INTERVAL, "what RQ's CLI passes"
    worker = worker_class([queue], connection=rconn, **cli)
    assert worker.maintenance_interval == MAINTENANCE_INTERVAL
    chosen = worker_class([queue], connection=rconn, maintenance_interval=300)
    assert chosen.maintenance_interval == 300


def rq_cli_worker_kwargs() -> dict[str, object]:
    """The maintenance interval RQ's ``rq worker`` command passes when none is given."""
    from rq.cli import workers as rq_cli

    option = next(p for p in rq_cli.worker.params if p.name == "maintenance_interval")
    return {"maintenance_interval": option.default}


@pytest.mark.slow
@pytest.mark.parametrize("worker_class", ["JoblockWorker", "JoblockSimpleWorker"])
def test_a_burst_worker_with_the_scheduler_starts_no_scheduler_process(worker_class, rconn):
    """``--with-scheduler --burst`` enqueues the due scheduled jobs once and quits (RQ). The
    scheduler take-over of the liveness sweep once started a scheduler *process* after the
    first job of such a worker: its exit then waited on that process, forever when the
    SIGTERM reached the fork before the scheduler's own handler (README's tour hung in CI)."""
    crew = Workers()
    try:
        job = jobs.hold_resource.delay(7, "burst-scheduler", 0.0)
        done = subprocess.run(
            [
                *(sys.executable, "-m", "django", "joblock_worker", "default"),
                *("--with-scheduler", "--burst", "--worker-class"),
                f"django_joblock.worker.{worker_class}",
            ],
            cwd=ROOT,
            env=crew.env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, output
        assert job.get_status(refresh=True) is JobStatus.FINISHED, output
        assert "done, quitting" in output, "negative control: the worker ran its burst"
        assert "Scheduler for default started" not in output, output
    finally:
        crew.stop()


@pytest.mark.parametrize("worker_class", [JoblockWorker, JoblockSimpleWorker])
def test_a_worker_exits_when_its_pubsub_thread_missed_the_stop(worker_class, rconn):
    """RQ's teardown sends UNSUBSCRIBE, then stops its pubsub thread, and redis-py 8's ``stop()``
    waits for that thread. A thread that read the reply before the stop flag was set (the main
    thread descheduled after the send on a busy box; here a 0.5 s pause) waits RQ's 60 s for a
    new subscription: a SIGTERMed idle worker of the failover chaos run was still up after 20 s.
    Ours leave the thread behind (a daemon) within the 10 s a SIGTERM may take."""
    worker = worker_class([Queue("default", connection=rconn)], connection=rconn)
    worker.subscribe()
    assert wait_for(lambda: worker.pubsub.subscribed, 10)
    send = worker.pubsub.unsubscribe

    def descheduled(*args: Any) -> Any:
        reply = send(*args)
        time.sleep(0.5)
        return reply

    worker.pubsub.unsubscribe = descheduled
    teardown = threading.Thread(target=worker.unsubscribe, daemon=True)
    teardown.start()
    teardown.join(10)
    assert not teardown.is_alive(), "the worker's teardown waits for its pubsub thread"
    assert worker.pubsub_thread.is_alive(), "negative control: the thread missed the stop"


@pytest.mark.slow
@pytest.mark.parametrize("worker_class", [JoblockWorker, JoblockSimpleWorker])
def test_a_worker_goes_on_after_an_outage_at_a_jobs_start(worker_class, rconn, caplog):
    """Redis gone at RQ's first write for a job it has just dequeued (the execution record; a
    failover did it in test_sentinel.py, once in CI) used to end the worker with a traceback.
    Ours log it and go back to the dequeue; the job stays in RQ's intermediate queue, which
    RQ's maintenance hands out again, and the next job runs once Redis is back."""
    upstream = rconn.connection_pool.connection_kwargs
    port = free_port()
    links = [Proxy(port, upstream["port"])]
    # No client retries: the outage outlasts them (redis-py 8 retries a failed command 3 times).
    queues = redis.Redis(port=port, db=upstream.get("db", 0), retry=Retry(NoBackoff(), 0))
    queue = Queue("default", connection=queues)
    first, second = queue.enqueue("os.getpid"), queue.enqueue("os.getpid")

    class CutAtStart(worker_class):  # type: ignore[misc, valid-type]
        def prepare_execution(self, job: Any) -> Any:
            if job.id == first.id:  # a real outage: connections reset, new ones refused
                links[0].close()
                threading.Timer(0.5, lambda: links.append(Proxy(port, upstream["port"]))).start()
            return super().prepare_execution(job)

    try:
        with caplog.at_level("WARNING", logger="django_joblock"):
            CutAtStart([queue], connection=queues).work(burst=True)
        assert "Redis unavailable in its start of job" in caplog.text, caplog.text
        assert second.get_status(refresh=True) == JobStatus.FINISHED
        assert first.id in queue.intermediate_queue.get_job_ids()  # not lost: RQ's to retry
        assert len(links) == 2, "negative control: the link was cut and opened again"
    finally:
        for link in links:
            link.close()
        queues.close()


@pytest.mark.slow
def test_a_worker_restarted_under_its_name_after_a_crash_starts_at_once(rconn):
    """A supervisor restarts a SIGKILLed ``--name``d worker (OOM killer, a node's hard stop):
    RQ refused the name while the dead worker's key lived (``worker_ttl`` + 60 = 480 s) with a
    ``ValueError`` traceback, so the queue had no worker for 8 minutes. A worker of that name
    whose pid is gone from this host is dead: the new one takes its name and runs the queue."""
    crew = Workers(extra_args=["--name", "restarted-worker"])
    try:
        first = crew.start()
        assert wait_for(lambda: rconn.hget("rq:worker:restarted-worker", "state") == b"idle", 30)
        os.kill(first.pid, signal.SIGKILL)  # no death registered
        first.wait(10)
        assert rconn.exists("rq:worker:restarted-worker"), "the dead worker's key lives on"
        second = crew.start()
        job = jobs.hold_resource.delay(9, "restarted-name", 0.0)
        assert wait_status(job, {JobStatus.FINISHED, JobStatus.FAILED}, 30, crew) is (
            JobStatus.FINISHED
        )
        assert second.poll() is None, crew.logs()
        assert "was not stopped" in crew.logs(), "the take-over is logged"
    finally:
        crew.stop()


def test_a_name_a_live_worker_may_hold_is_refused_in_one_line(rconn):
    """A worker of that name registered from another host (or under a pid still running) may be
    alive: the name is refused, as RQ refuses it, in one line (RQ's ValueError traceback before)."""
    rconn.hset("rq:worker:taken-name", mapping={"hostname": "another-host", "pid": 1})
    rconn.expire("rq:worker:taken-name", 60)
    with pytest.raises(CommandError, match="There exists an active worker named 'taken-name'"):
        call_command("joblock_worker", "default", "--burst", "--name", "taken-name")
    assert not rconn.hexists("rq:worker:taken-name", "death"), "left to its live owner"

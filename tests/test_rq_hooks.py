"""Contract tests of the RQ ``Worker`` hooks that ``django_joblock.worker`` overrides: each
fails if RQ's behaviour under the hook changes (its arguments, when RQ calls it, what RQ does in
it), on rq 2.12 and 3.x alike. The hooks and these tests are listed in docs/architecture.md
("RQ's worker hooks"); the behaviour each override adds has its own tests, named there."""

from __future__ import annotations

import inspect
import logging
import os
import re
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.client import PubSubWorkerThread
from redis.retry import Retry
from rq import Queue, SimpleWorker, Worker
from rq.defaults import DEFAULT_MAINTENANCE_TASK_INTERVAL
from rq.worker import WorkerStatus

from django_joblock.jobs import admission, liveness
from django_joblock.worker import MAINTENANCE_INTERVAL, JoblockSimpleWorker, JoblockWorker
from tests import admission_jobs
from tests.harness import ROOT, free_port, wait_for
from tests.workers import Workers, exited, pid_of

pytestmark = pytest.mark.django_db(transaction=True)

# RQ's parameters (after self) each override relies on: a prefix of RQ's list, per version.
SIGNATURES: dict[str, list[list[str]]] = {
    "__init__": [["queues", "name", "default_result_ttl", "connection", "exception_handlers"]],
    "work": [["burst"]],
    "handle_warm_shutdown_request": [[]],
    "register_birth": [[]],
    "handle_execution_ended": [["job", "queue", "heartbeat_ttl"]],
    "maintain_heartbeats": [["job"], ["job", "execution"]],  # rq 2, rq 3
    "set_state": [["state", "pipeline"]],
    "dequeue_job_and_maintain_ttl": [["timeout", "max_idle_time"]],
    "heartbeat": [["timeout", "pipeline"]],
    "check_for_suspension": [["burst"]],
    "execute_job": [["job", "queue"]],
    "perform_job": [["job", "queue"], ["job", "queue", "execution"]],  # rq 2, rq 3
    "run_maintenance_tasks": [[]],
    "unsubscribe": [[]],
    "fork_work_horse": [["job", "queue"]],
    "handle_job_failure": [["job", "queue", "started_job_registry", "exc_string"]],
}
PROPERTIES = {"dequeue_timeout"}


def _overridden() -> set[str]:
    """The attributes of RQ's Worker / SimpleWorker that our worker classes define."""
    found = set()
    for ours, theirs in ((JoblockWorker, Worker), (JoblockSimpleWorker, SimpleWorker)):
        for cls in ours.__mro__:
            if cls.__module__.startswith("rq."):
                break
            found |= {name for name in vars(cls) if hasattr(theirs, name)}
    return found - {"__module__", "__doc__", "__dict__", "__weakref__", "__annotations__"}


def _documented() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## RQ's worker hooks", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)`", table, flags=re.MULTILINE))


def test_every_overridden_hook_is_documented_and_has_a_signature_contract():
    overridden = _overridden()
    assert overridden == set(SIGNATURES) | PROPERTIES
    assert _documented() == overridden, "docs/architecture.md lists every override"


@pytest.mark.parametrize("hook", sorted(SIGNATURES))
def test_rq_still_calls_the_hook_with_these_arguments(hook):
    theirs = Worker if hasattr(Worker, hook) else SimpleWorker
    params = list(inspect.signature(getattr(theirs, hook)).parameters)[1:]
    assert any(params[: len(wanted)] == wanted for wanted in SIGNATURES[hook]), params
    if hook == "__init__":
        assert "maintenance_interval" in params
        assert DEFAULT_MAINTENANCE_TASK_INTERVAL == 600, "RQ's default, taken as 'not chosen'"


def test_dequeue_timeout_is_what_rqs_idle_loop_waits_between_heartbeats(rconn):
    """RQ's dequeue loop calls ``heartbeat()`` (where ours sweeps) once per ``dequeue_timeout``:
    ours is 1 s, so an idle worker sweeps every second; RQ's own waits ``worker_ttl - 15`` s."""
    beats: list[float] = []

    class Counting(JoblockSimpleWorker):
        def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
            if pipeline is None:
                beats.append(time.monotonic())
            super().heartbeat(timeout, pipeline)

    worker = Counting([Queue("default", connection=rconn)], connection=rconn)
    assert worker.dequeue_timeout == liveness.INTERVAL == 1
    assert worker.maintenance_interval == MAINTENANCE_INTERVAL
    worker.work(max_idle_time=4)
    assert len(beats) >= 4, beats


def test_rqs_sigterm_handler_calls_handle_warm_shutdown_request_and_nothing_starts(rconn):
    """RQ's SIGTERM handler (``request_stop``) calls ``handle_warm_shutdown_request``: from then
    on our heartbeat sweeps no more and the maintenance pass does nothing (RQ's would start a
    scheduler process). Negative control: before the signal the heartbeat sweeps."""
    queue = Queue("default", connection=rconn)
    running = JoblockSimpleWorker([queue], connection=rconn)
    running.heartbeat()  # its first heartbeat sweeps
    assert not liveness.claim_turn(rconn), "negative control: an idle worker sweeps (its turn)"
    time.sleep(liveness.INTERVAL)  # the turn expires
    worker = JoblockSimpleWorker([queue], connection=rconn)
    worker.register_birth()
    try:
        worker.set_state(WorkerStatus.BUSY)  # mid-job: RQ finishes the job, then stops
        worker.request_stop(signal.SIGTERM, None)
        assert worker.stop_requested
        worker.heartbeat()
        assert liveness.claim_turn(rconn), "no sweep once asked to stop: the turn is free"
        worker.run_maintenance_tasks()
        assert worker.last_cleaned_at is None, "no maintenance once asked to stop"
    finally:
        worker.register_death()


class RQSimpleWorker(SimpleWorker):
    """RQ's ``SimpleWorker`` with only the end of its exit bounded: RQ's ``unsubscribe`` may
    wait 60 s for its pubsub thread (the test below), which a negative control about the
    scheduler does not need to wait for."""

    def unsubscribe(self) -> None:
        rq_unsubscribe = threading.Thread(target=super().unsubscribe, daemon=True)
        rq_unsubscribe.start()
        rq_unsubscribe.join(1)


@pytest.mark.parametrize("worker_class", [JoblockWorker, JoblockSimpleWorker])
def test_a_burst_worker_with_the_scheduler_enqueues_due_jobs_and_starts_no_scheduler(
    worker_class, rconn, caplog
):
    """RQ's own ``test_work_burst`` (tests/test_scheduler.py) with our classes: after
    ``work(burst=True, with_scheduler=True)`` the worker has its scheduler, whose lock and
    metadata are gone. A maintenance pass during the burst (interval 1 s, a 2.5 s job) cleans
    RQ's registries but starts no scheduler process. Negative control: RQ's own SimpleWorker
    acquires the scheduler lock a second time in that pass, to start one."""
    queue = Queue("default", connection=rconn)

    def burst(cls: Any) -> Any:
        rconn.flushdb()
        queue.enqueue_in(timedelta(seconds=0), admission_jobs.plain_interval, "due", 0.0)
        queue.enqueue(admission_jobs.plain_interval, "long", 2.5)
        caplog.clear()
        worker = cls([queue], connection=rconn, maintenance_interval=1)
        with caplog.at_level(logging.INFO, logger="rq.scheduler"):
            worker.work(burst=True, with_scheduler=True)
        return worker

    worker = burst(worker_class)
    assert worker.scheduler
    assert rconn.get(worker.scheduler.get_locking_key("default")) is None
    assert not rconn.exists(worker.scheduler.key)
    assert worker.last_cleaned_at is not None, "RQ's registry clean-up ran"
    acquired = [r for r in caplog.records if "Acquired scheduler lock" in r.getMessage()]
    assert len(acquired) == 1, "only the start's, which enqueued the due job"
    assert queue.scheduled_job_registry.count == 0, "the due job was enqueued (and ran)"
    plain = burst(RQSimpleWorker)  # negative control
    acquired = [r for r in caplog.records if "Acquired scheduler lock" in r.getMessage()]
    assert len(acquired) == 2, "RQ's maintenance pass took the lock again to start a scheduler"
    assert plain.scheduler


@pytest.mark.slow
@pytest.mark.parametrize("worker_class", [JoblockWorker, JoblockSimpleWorker])
def test_unsubscribe_ends_within_a_second_when_the_pubsub_thread_waits(worker_class, proxy):
    """RQ's ``unsubscribe`` waits for its pubsub thread (redis-py 8's ``stop()`` joins it); when
    the UNSUBSCRIBE reply does not wake it (here a black-holed connection; in practice a reply
    read before the stop flag) that is its 60 s read. Ours returns within RQ's own 1 s. Negative
    control: RQ's own ``unsubscribe`` is still waiting after 5 s."""
    from django_redis import get_redis_connection

    connection = get_redis_connection("proxied")
    queue = Queue("default", connection=connection)

    def subscribed() -> Any:
        worker = worker_class([queue], connection=connection)
        worker.subscribe()
        time.sleep(0.3)  # the pubsub thread is in its read
        return worker

    worker = subscribed()
    proxy.set("blackhole")
    started = time.monotonic()
    worker.unsubscribe()
    assert time.monotonic() - started < 3
    proxy.set("forward")
    worker = subscribed()
    proxy.set("blackhole")
    theirs = threading.Thread(target=Worker.unsubscribe, args=(worker,), daemon=True)
    theirs.start()
    theirs.join(5)
    # redis-py 8's stop() joins the thread (redis-py 5's only asks it to stop).
    joins = "timeout" in inspect.signature(PubSubWorkerThread.stop).parameters
    assert theirs.is_alive() is joins, "negative control: RQ's own waits on where stop() joins"
    proxy.set("forward")


@pytest.mark.slow
@pytest.mark.skipif(not admission.supported(), reason="rq 2.x frees no rate-limit slot")
@pytest.mark.parametrize("ours", [True, False], ids=["JoblockWorker", "negative control: rq"])
def test_handle_job_failure_releases_the_lock_before_rq_frees_the_slot(ours, settings, rconn):
    """RQ calls ``handle_job_failure`` in the worker's parent for a horse that died, and frees
    the job's rate-limit slot at its end (promoting the parked job onto the queue). Ours
    releases the lock the dead horse held first: Redis's keyspace events show the lock's DEL
    before the parked job's push onto the queue. Negative control: RQ's own worker leaves the
    lock to its TTL."""
    rconn.config_set("notify-keyspace-events", "KEA")
    pubsub = rconn.pubsub()
    pubsub.psubscribe("__keyevent@*__:*")
    crew = Workers(settings.JOBLOCK, extra_args=[] if ours else ["--worker-class=rq.Worker"])
    try:
        crew.start("default", command="joblock_worker" if ours else "rqworker")
        label = f"hook-{os.getpid()}-{time.monotonic_ns()}"
        admission_jobs.long_hold.delay(39, label)
        horse = pid_of(rconn, label)
        parked = admission_jobs.hot.delay(39, f"{label}-next", 0.05)
        assert parked.get_status(refresh=True) == "rate_limited"
        while pubsub.get_message(timeout=0.1) is not None:
            pass  # the events so far
        os.kill(horse, signal.SIGKILL)
        assert wait_for(lambda: exited(horse), 10)
        events: list[tuple[str, str]] = []

        def pushed() -> bool:
            message = pubsub.get_message(timeout=0.1)
            if message is not None and message["type"] == "pmessage":
                event = message["channel"].decode().rsplit(":", 1)[1]
                events.append((event, message["data"].decode()))
            return any(key == "rq:queue:default" for _event, key in events)

        assert wait_for(pushed, 10), events
        lock_key = "joblock:{hot:39}:lock"
        deleted = [n for n, (event, key) in enumerate(events) if key == lock_key and event == "del"]
        pushed_at = next(n for n, (_event, key) in enumerate(events) if key == "rq:queue:default")
        if ours:
            assert deleted and deleted[0] < pushed_at, events
        else:
            assert not deleted and rconn.exists(lock_key), events
    finally:
        crew.stop()
        pubsub.close()
        rconn.config_set("notify-keyspace-events", "")


@pytest.mark.parametrize(
    ("hook", "args"),
    [("set_state", (WorkerStatus.IDLE,)), ("check_for_suspension", (False,)), ("heartbeat", ())],
)
def test_rq_quits_on_a_redis_error_in_the_hook_where_ours_goes_on(hook, args, rconn):
    """RQ's ``set_state``, ``check_for_suspension`` and ``heartbeat`` raise on a Redis error
    (and its worker quits: "found an unhandled exception, quitting"); ours log it and go on."""
    worker = JoblockSimpleWorker([Queue("default", connection=rconn)], connection=rconn)
    # A server that refuses the connection, without redis-py's retries: one error per command.
    worker.connection = redis.Redis(
        port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
    )
    with pytest.raises(redis.exceptions.ConnectionError):
        getattr(SimpleWorker, hook)(worker, *args)  # RQ's own
    getattr(worker, hook)(*args)

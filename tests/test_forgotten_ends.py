"""Executions whose end a failover forgot, settled by their idle workers (rq >= 3;
docs/architecture.md, "Recovery"; :meth:`django_joblock.worker.JoblockWorker.settle_forgotten`).

A Sentinel failover can forget how a job ended: on the promoted primary the job is still
started, its execution still in the queue's started registry and in its worker's execution
index. Several workers settle theirs at about the same moment after a failover, while RQ's
maintenance may clean the registry too. RQ's registry clean-up reads the expired executions and,
after handling them, deletes every entry up to its cut-off second: an execution expired in that
second by another process was deleted without being handled (the chaos run
``sentinel-queues`` found one job left started and in no registry for ever).

The failover itself is in ``tests/test_sentinel.py``; here the forgotten state is written
directly (what the promoted primary holds), and the settling runs in real worker objects on the
real Redis, concurrently, as the workers' idle sweeps would.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from rq import Queue, Worker
from rq.job import JobStatus
from rq.registry import FailedJobRegistry, StartedJobRegistry

from django_joblock.jobs import admission
from django_joblock.worker import JoblockSimpleWorker
from tests.harness import wait_for

pytestmark = pytest.mark.skipif(
    not admission.supported(), reason="rq 2.x keeps no execution index per worker"
)

WORKERS = 30
ROUNDS = 8  # the loss needs an unlucky interleaving: on the code before, it came by round 3
SETTLE_WITHIN = 30.0  # seconds: a sweep a second per worker, a few passes each


def forgotten(queue: Queue, name: str) -> tuple[JoblockSimpleWorker, Any]:
    """An idle worker and the job it ran whose end Redis forgot: the job started, its execution
    in the started registry (expiring only after RQ's heartbeat slack) and the worker's index."""
    worker = JoblockSimpleWorker([queue], connection=queue.connection, name=name)
    worker.register_birth()
    job = queue.enqueue("tests.jobs.hold_resource", 1, name, 0.0)
    queue.connection.lrem(queue.key, 1, job.id)  # dequeued
    worker.prepare_execution(job)
    worker.prepare_job_execution(job)
    worker.executions.clear()  # the worker's own memory of it ended with the job
    return worker, job


def settle_at_once(queue: Queue, crew: list[tuple[JoblockSimpleWorker, Any]]) -> str:
    """Every worker sweeping every 0.2 s and RQ's maintenance in a loop, until each job is
    failed and off its worker's index, or one is lost; what is wrong, or ``""``."""
    started = StartedJobRegistry(queue=queue)
    go = threading.Event()
    done = threading.Event()

    def sweeps(worker: JoblockSimpleWorker) -> None:
        go.wait()
        while not done.is_set():  # the idle worker's sweep, once a liveness interval
            worker.settle_forgotten()
            time.sleep(0.2)

    def maintenance() -> None:  # RQ's own, as other workers run it
        go.wait()
        while not done.is_set():
            Worker([queue], connection=queue.connection).clean_registries()
            time.sleep(0.05)

    def state() -> str:
        in_started = set(started.get_job_ids(cleanup=False))
        for worker, job in crew:
            status = job.get_status(refresh=True)
            if status == JobStatus.STARTED and job.id not in in_started:
                return f"job {job.id} (of {worker.name}) lost: started, in no registry"
            if status != JobStatus.FAILED or worker.get_current_executions(refresh=True):
                return f"job {job.id} (of {worker.name}) {status}, not settled yet"
        return ""

    threads = [threading.Thread(target=sweeps, args=(worker,)) for worker, _ in crew]
    threads.append(threading.Thread(target=maintenance))
    for thread in threads:
        thread.start()
    go.set()
    try:
        wait_for(lambda: not state() or " lost: " in state(), SETTLE_WITHIN)
    finally:
        done.set()
        for thread in threads:
            thread.join()
    return state()


def test_workers_settling_at_once_leave_no_job_started_in_no_registry(rconn):
    queue = Queue("forgotten", connection=rconn)
    for round_ in range(ROUNDS):
        crew = [forgotten(queue, f"forgetful-{round_}-{n}") for n in range(WORKERS)]
        # The fault is real: every job is started, its execution not expiring for a minute.
        assert {job.get_status(refresh=True) for _, job in crew} == {JobStatus.STARTED}
        live = rconn.zrangebyscore(StartedJobRegistry(queue=queue).key, time.time() + 30, "+inf")
        assert len(live) == WORKERS
        assert settle_at_once(queue, crew) == "", f"round {round_}"
        failed = set(FailedJobRegistry(queue=queue).get_job_ids())
        assert {job.id for _, job in crew} <= failed

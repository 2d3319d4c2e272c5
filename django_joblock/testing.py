"""Test helpers for projects using ``@locked_job`` (docs/testing.md): :func:`run_jobs` runs
queued jobs *in the test process* with the real flow and RQ's real requeues, and
:func:`no_locks_held` / :func:`assert_no_locks_held` fail a test that leaves a lock held. They
need a real Redis and writes that commit (``TransactionTestCase``, ``transaction=True``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rq import Worker
from rq.job import Job, JobStatus

from .jobs.admission import PARKED
from .jobs.queues import get_queue
from .locks.renewal import renewer
from .worker import JoblockSimpleWorker, default_job_class


class InProcessWorker(JoblockSimpleWorker):
    """The in-process worker of ``joblock_worker --simple`` (its fixes to RQ's loop included),
    which leaves the test case's database connections open; ``seen`` is called with every job
    it runs, including those RQ promoted from admission."""

    seen: Any = None

    def execute_job(self, job: Job, queue: Any) -> Any:
        if self.seen is not None:
            self.seen([job.id])
        return super().execute_job(job, queue)


@dataclass
class Run:
    """What :func:`run_jobs` did: the jobs it saw (in the order first seen) and the rounds."""

    jobs: list[Job] = field(default_factory=list)
    rounds: int = 0
    fast_forwarded: int = 0

    def statuses(self) -> dict[str, JobStatus | None]:
        """Job id -> its status now."""
        return {job.id: job.get_status(refresh=True) for job in self.jobs}

    def outcomes(self) -> dict[str, str | None]:
        """Job id -> ``job.meta["joblock"]["outcome"]`` (ran, replayed, requeued, ...)."""
        meta = {job.id: job.get_meta(refresh=True) for job in self.jobs}
        return {job_id: each.get("joblock", {}).get("outcome") for job_id, each in meta.items()}

    @property
    def pending(self) -> list[Job]:
        """Jobs still waiting when the rounds ran out (e.g. behind a lock held forever)."""
        waiting = {JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED, PARKED}
        return [job for job in self.jobs if job.get_status(refresh=True) in waiting]


def _refuse_live_workers(queues: list[Any]) -> None:
    """Refuse (naming them) workers on the drained queues: they would race the test for its jobs
    and run them against *their* database (docs/testing.md)."""
    for queue in queues:
        if found := Worker.all(queue=queue):
            names = ", ".join(sorted(f"{each.name} (pid {each.pid})" for each in found))
            raise RuntimeError(
                f"run_jobs(): queue {queue.name!r} has live workers on its Redis: {names}. "
                "They would take the test's jobs and run them against their own database. "
                "Give the tests a Redis database of their own (docs/testing.md, 'Settings for "
                "tests'), or stop those workers."
            )


def _fast_forward(queue: Any) -> int:
    """Move the queue's scheduled jobs onto the queue now."""
    registry = queue.scheduled_job_registry
    moved = 0
    for job_id in registry.get_job_ids():
        registry.remove(job_id)
        try:
            job = Job.fetch(job_id, connection=queue.connection, serializer=queue.serializer)
        except Exception:  # noqa: BLE001 - deleted meanwhile: nothing to run
            continue
        queue.enqueue_job(job)
        moved += 1
    return moved


def run_jobs(*queues: Any, fast_forward: bool = True, max_rounds: int = 100) -> Run:
    """Run every job waiting on ``queues`` (names or ``rq.Queue``; default ``"default"``) here,
    in rounds: an in-process worker drains them (burst), then, with ``fast_forward``, what RQ
    scheduled meanwhile (requeues, ``Retry``, ``enqueue_in``) goes back onto its queue. Stops
    when nothing is left, or after ``max_rounds`` (``Run.pending`` lists what still waits)."""
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"run_jobs(): max_rounds must be an int >= 1, got {max_rounds!r}.")
    resolved = [get_queue(queue) for queue in (queues or ("default",))]
    _refuse_live_workers(resolved)
    connection = resolved[0].connection
    run = Run()
    seen: set[str] = set()

    def note(ids: list[str]) -> None:
        for job_id in ids:
            if job_id not in seen:
                seen.add(job_id)
                run.jobs.append(Job.fetch(job_id, connection=connection))

    while run.rounds < max_rounds:
        for queue in resolved:
            note([*queue.get_job_ids(), *queue.scheduled_job_registry.get_job_ids()])
        run.rounds += 1
        worker = InProcessWorker(resolved, connection=connection, job_class=default_job_class())
        worker.seen = note
        worker.work(burst=True, with_scheduler=False)
        moved = sum(_fast_forward(queue) for queue in resolved) if fast_forward else 0
        run.fast_forwarded += moved
        if not moved and not any(queue.count for queue in resolved):
            break
    return run


def assert_no_locks_held() -> None:
    """Raise ``AssertionError`` naming every lock this process holds right now."""
    if held := renewer().held_locks():
        names = ", ".join(sorted(f"{lock.resource} (owner {lock.owner})" for lock in held))
        raise AssertionError(f"{len(held)} lock(s) left held: {names}")


@contextlib.contextmanager
def no_locks_held() -> Iterator[None]:
    """Fail the block if it leaves a lock held (and none may be held when it starts)."""
    assert_no_locks_held()
    yield
    assert_no_locks_held()

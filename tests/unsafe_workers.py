"""Negative controls for tests/test_pauses.py: workers with the scheduler take-over that
django_joblock.worker used to have (removed: it broke exclusion). A scheduler whose lock was not
renewed for 4 s was taken for dead, its lock deleted and a scheduler started here; a scheduler
that was only paused resumes and enqueues the due jobs it had read a second time."""

from __future__ import annotations

from typing import Any

from rq.scheduler import RQScheduler
from rq.scripts import release_lock

from django_joblock.backend import text
from django_joblock.worker import JoblockWorker

STALE = 4  # seconds without a renewal after which the old code took a scheduler for dead


def take_over_scheduler(worker: Any) -> None:
    scheduler = worker.scheduler
    if scheduler is None:  # the old code also ran once the worker was asked to stop
        return
    names = worker.queue_names()
    renewed_to = scheduler.interval + 60  # RQ's lock TTL, set afresh on every renewal
    vacant = False
    for name in names:
        key = RQScheduler.get_locking_key(name)
        owner, ttl = worker.connection.get(key), worker.connection.ttl(key)
        if owner is None:
            vacant = True
        elif ttl < renewed_to - STALE:
            vacant |= bool(release_lock(worker.connection, key, text(owner)))
    if vacant:
        scheduler.acquire_locks(auto_start=True)


class TakeOverWorker(JoblockWorker):
    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        super().heartbeat(timeout, pipeline)
        if pipeline is None:
            take_over_scheduler(self)

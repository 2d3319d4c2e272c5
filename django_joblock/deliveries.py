"""The delivery history of an idempotency key: every run of it by an RQ worker, bounded.

The article's first debugging question is "did the queue really deliver it twice?". Each
run of a ``@locked_job`` with an idempotency key appends one entry when it ends: its RQ job
id, worker, host and pid, when it started (Unix seconds, the worker's clock), its outcome
(``ran``, ``replayed``, ``requeued``, ``failed``, ``aborted``, ``skipped``, ``gave_up``), the
wait from enqueue, and for a duplicate in flight the job id of the delivery it ran beside.

The history is a Redis LIST of JSON entries on the *queue's* connection, next to RQ's jobs
(key ``keys.deliveries_key``): written by :mod:`django_joblock.outcomes` in the same round
trip as the job's outcome meta (no extra round trip), trimmed to the last
:data:`KEPT` entries and expiring with the idempotency record (``IDEMPOTENCY_TTL``). Losing
it (a Redis restart without persistence) loses history, never correctness: the record in
the database is what stops a second effect.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from . import conf
from .backend import REDIS_ERRORS, text
from .holders import HOST
from .keys import deliveries_key

#: Entries kept per key (the newest).
KEPT = 20


@dataclass(frozen=True)
class Delivery:
    """One run of a key: who ran it, when, and how it ended."""

    job_id: str
    worker: str
    host: str
    pid: int | None
    started: float | None  # Unix seconds
    outcome: str
    waited: float | None = None
    duplicate_of: str = ""  # a duplicate in flight: the job it ran beside
    resource: str = ""  # the resource its lock was on ("" without a lock)
    took: float | None = None  # seconds from the run's start to its end
    timeout: float | None = None  # the RQ job's job_timeout (seconds; None: none or unknown)


def add_commands(scope: str, key: str, entry: Delivery) -> list[list[Any]]:
    """The commands that append ``entry`` to the history, for the job's own outcome round
    trip on the queue's connection (:func:`django_joblock.outcomes.finish`)."""
    settings = conf.get()
    name = deliveries_key(settings.KEY_PREFIX, scope, key)
    return [
        ["RPUSH", name, json.dumps(entry.__dict__, separators=(",", ":"))],
        ["LTRIM", name, -KEPT, -1],
        ["EXPIRE", name, max(1, int(settings.IDEMPOTENCY_TTL))],
    ]


def entry(
    job: Any,
    outcome: str,
    began: float,
    waited: float | None,
    *,
    resource: str | None = None,
    duplicate_of: str = "",
) -> Delivery:
    """The entry of a run of ``job`` that began ``began`` (monotonic) and ended now."""
    took = time.monotonic() - began
    limit = getattr(job, "timeout", None)
    return Delivery(
        job_id=str(job.id),
        worker=str(getattr(job, "worker_name", "") or ""),
        host=HOST.decode(errors="replace"),
        pid=os.getpid(),
        started=round(time.time() - took, 3),
        outcome=outcome,
        waited=None if waited is None else round(waited, 3),
        duplicate_of=duplicate_of,
        resource=resource or "",
        took=round(took, 3),
        timeout=float(limit) if isinstance(limit, (int, float)) and limit > 0 else None,
    )


def history(connection: Any, scope: str, key: str) -> list[Delivery]:
    """The history of ``key`` in ``scope`` in the order the runs started, read from
    ``connection`` (the queue's Redis; entries are appended when a run ends). Empty when there
    is none, or Redis cannot be read (history is an aid, not state)."""
    try:
        raw = connection.lrange(deliveries_key(conf.get().KEY_PREFIX, scope, key), 0, -1)
    except REDIS_ERRORS:
        return []
    found = []
    for item in raw:
        try:
            data = json.loads(text(item))
            found.append(Delivery(**data))
        except (ValueError, TypeError):
            continue  # an entry of another version: skip it
    return sorted(found, key=lambda d: d.started if d.started is not None else float("inf"))


def summary(found: list[Delivery]) -> str:
    """One line: how many deliveries (distinct RQ job ids) and runs, and what each run did."""
    jobs = {d.job_id for d in found}
    outcomes: dict[str, int] = {}
    for delivery in found:
        outcomes[delivery.outcome] = outcomes.get(delivery.outcome, 0) + 1
    shown = ", ".join(f"{n} {name}" for name, n in sorted(outcomes.items()))
    return f"{len(jobs)} deliveries (RQ jobs), {len(found)} runs: {shown}" if found else ""

"""How one run of a ``@locked_job`` ends (:func:`finish`): ``job.meta["joblock"]`` gets its
``outcome`` (a :class:`JobOutcome`), a ``reason`` unless it ran or replayed, and ``waited``
(seconds from enqueue to the start of the run that took the lock; keep hosts' clocks synced, a
negative difference counts as 0). RQ never saves ``meta`` when a job ends, so it is written
after the job's commit, with the run's :mod:`.history` entry, in one round trip; a failed write
is logged, never a job failure. Each run logs **one** line on ``django_joblock`` (INFO; DEBUG
inline): ``job <id> <outcome>: <function> resource=<r> key=<k>``, with the holder when busy, a
requeue's delay and the reason.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .. import conf, metrics
from ..backend import REDIS_ERRORS, raise_refused, send
from ..idempotency.inputs import key_family
from ..locks.keys import family
from ..logs import logger
from . import history
from .spec import JobSpec


class JobOutcome(enum.StrEnum):
    """``job.meta["joblock"]["outcome"]`` after a run by a worker."""

    RAN = "ran"  # the function ran and its effect committed
    REPLAYED = "replayed"  # an earlier run succeeded: its stored result was returned
    REQUEUED = "requeued"  # busy: RQ runs the same job again after a delay
    SKIPPED = "skipped"  # busy, on_conflict="skip": finished without running
    FAILED = "failed"  # raised: on_conflict="fail", or the function (or RQ's timeout) raised
    GAVE_UP = "gave_up"  # busy for longer than max_wait: LockContentionTimeout
    ABORTED = "aborted"  # the lock was lost while running: LockLost, effect rolled back


# These runs raised: RQ fails the job, or retries it when its Retry has retries left.
RAISED = frozenset({JobOutcome.FAILED, JobOutcome.ABORTED, JobOutcome.GAVE_UP})


@dataclass
class Run:
    """One run of a job. ``job``: the RQ job (None inline); ``worker``: an RQ worker runs it,
    so it can be requeued (False on a synchronous queue, which runs it inline at enqueue)."""

    spec: JobSpec[Any, Any]
    resource: str | None
    key: str | None
    job: Any
    worker: bool
    holder: str = ""  # who held the resource, when it was busy (for the log line)
    waited: float | None = None
    began: float = field(default_factory=time.monotonic)

    @property
    def family(self) -> str:
        """The metrics family: the resource's, else the idempotency key's (bounded)."""
        return family(self.resource) if self.resource is not None else key_family(self.key or "")

    def note_duration(self) -> None:
        """Count ``near_timeout`` for a worker's run that took ``ALERTS["TIMEOUT_RATIO"]`` of
        its RQ ``job_timeout`` or more (or that RQ's timeout killed: it unwinds through here)."""
        timeout = getattr(self.job, "timeout", None)
        if not self.worker or not isinstance(timeout, (int, float)) or timeout <= 0:
            return
        if time.monotonic() - self.began >= conf.get().ALERTS["TIMEOUT_RATIO"] * timeout:
            metrics.count("near_timeout", self.family, self.spec.name)

    def started(self) -> None:
        """The run took its lock (or needs none): record the wait since enqueue."""
        created = getattr(self.job, "created_at", None)  # None inline
        if created is None or self.waited is not None:
            return
        self.waited = max(0.0, time.time() - created.timestamp())
        metrics.observe("start_wait_seconds", self.family, self.spec.name, self.waited)


def finish(run: Run, outcome: JobOutcome, **extra: Any) -> None:
    """Record ``outcome`` and log the run's line (module docs); a worker's run that raised
    counts ``failed_runs``, and ``rq_retries`` when RQ retries it."""
    _log(run, outcome, extra)
    job = run.job
    if job is None:
        return
    if outcome in RAISED and run.worker:
        metrics.count("failed_runs", run.family, run.spec.name)
        if (getattr(job, "retries_left", None) or 0) > 0:  # RQ retries it next
            metrics.count("rq_retries", run.family, run.spec.name)
    state = job.meta.setdefault("joblock", {})
    state["outcome"] = outcome.value
    if "reason" not in extra:
        state.pop("reason", None)  # a reason from an earlier requeue no longer applies
    if run.waited is not None:
        state["waited"] = round(run.waited, 6)
    state.update(extra)
    calls: list[Any] = [["HSET", job.key, "meta", job.serializer.dumps(job.meta)]]
    if run.worker and (run.key is not None or run.resource is not None):
        twin = str(extra.get("duplicate_of", ""))
        done = history.entry(job, outcome.value, run.began, run.waited, run.key, run.resource, twin)
        calls += history.add_calls(done)
    try:
        raise_refused(send(job.connection, calls))
    except REDIS_ERRORS:
        logger.warning(
            "could not record outcome %s of job %s",
            outcome.value,
            job.id,
            exc_info=True,
            extra={"job_id": job.id, "outcome": outcome.value},
        )


def _log(run: Run, outcome: JobOutcome, extra: dict[str, Any]) -> None:
    level = logging.INFO if run.job is not None else logging.DEBUG
    if not logger.isEnabledFor(level):
        return
    job_id = getattr(run.job, "id", None)
    parts = [f"resource={run.resource or '-'}", f"key={run.key or '-'}"]
    if run.holder:
        parts.append(f"holder={run.holder}")
    if outcome is JobOutcome.REQUEUED:
        parts.append(f"in {extra.get('delays', [0])[-1]}s (requeue {extra.get('requeues')})")
    if run.waited is not None and outcome in (JobOutcome.RAN, JobOutcome.REPLAYED):
        parts.append(f"waited {run.waited:.3f}s")
    reason = extra.get("reason", "")
    if reason:
        parts.append(f"reason: {reason}")
    logger.log(
        level,
        "job %s %s: %s %s",
        job_id or "(inline)",
        outcome.value,
        run.spec.name,
        " ".join(parts),
        extra={
            "job_id": job_id,
            "resource": run.resource,
            "idempotency_key": run.key,
            "outcome": outcome.value,
            "reason": reason,
            "holder": run.holder,
            "waited": run.waited,
        },
    )

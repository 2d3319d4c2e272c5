"""How one run of a ``@locked_job`` ends: its outcome in ``job.meta``, one log line, metrics.

Every run of an RQ job ends with:

- ``job.meta["joblock"]["outcome"]`` set to a :class:`JobOutcome` (and, except for ``ran`` /
  ``replayed``, a ``reason``), plus ``waited``: seconds from the job's enqueue
  (``job.created_at``) to the start of the run that took its lock (a parked or requeued job
  waited that long; ``admission`` and ``requeues`` say how). RQ never saves ``meta`` when it
  finishes a job, so this is one ``HSET`` on the queue's connection, written after the job's
  transaction committed; a failure to write it is logged, never turned into a job failure.
- **one** INFO line on logger ``django_joblock``: ``job <id> <outcome>: <function>
  resource=<r> key=<k> ...`` with the holder (``host:pid``, owner hash, RQ job id) when the
  resource was busy, the delay of a requeue and the reason. Inline calls log it at DEBUG.

``waited`` compares the enqueuing host's clock (RQ's ``created_at``) with the worker's: keep
hosts NTP-synced (as for idempotency leases); a negative difference counts as 0.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ResponseError

from . import admission, conf, deliveries, lean, metrics, timeline
from .backend import REDIS_ERRORS
from .idempotency_inputs import key_family
from .jobspec import JobSpec
from .keys import family

logger = logging.getLogger("django_joblock")


class JobOutcome(enum.StrEnum):
    """``job.meta["joblock"]["outcome"]`` after a run by a worker."""

    RAN = "ran"  # the function ran and its effect committed
    REPLAYED = "replayed"  # an earlier run succeeded: its stored result was returned
    REQUEUED = "requeued"  # busy: RQ runs the same job again after a delay
    SKIPPED = "skipped"  # busy, on_conflict="skip": finished without running
    FAILED = "failed"  # raised: on_conflict="fail", or the function (or RQ's timeout) raised
    GAVE_UP = "gave_up"  # busy for longer than max_wait: LockContentionTimeout
    ABORTED = "aborted"  # the lock was lost while running: LockLost, effect rolled back


# After these the job does not run again: its admission slot can go to the next job.
FINAL_SUCCESS = frozenset({JobOutcome.RAN, JobOutcome.REPLAYED, JobOutcome.SKIPPED})
# These runs raised: RQ fails the job, or retries it when its Retry has retries left.
RAISED = frozenset({JobOutcome.FAILED, JobOutcome.ABORTED, JobOutcome.GAVE_UP})


@dataclass
class Run:
    """One run of a job: what it is about, and who runs it.

    ``job`` is the RQ job (None for an inline call); ``worker`` is True when an RQ worker runs
    it, so it can be requeued (a synchronous queue runs it inline at enqueue: False).
    """

    spec: JobSpec[Any, Any]
    resource: str | None
    key: str | None
    job: Any
    worker: bool
    admitted: bool = False  # holds an admission slot of its resource
    promoted: bool = False  # admitted from the waiting set: others may wait behind it too
    handed_off: bool = False
    idle: Any = None  # the resource's rate-limit registry, when nobody waited on it
    holder: str = ""  # who held the resource, when it was busy (for the log line)
    waited: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    began: float = field(default_factory=time.monotonic)

    @property
    def family(self) -> str:
        """The metrics family: the resource's, else the idempotency key's (bounded)."""
        if self.resource is not None:
            return family(self.resource)
        return key_family(self.key or "")

    def hand_off(self) -> None:
        """The job will not run again: give its admission slot to the next parked job.

        Called as soon as the body has returned (or a replay is decided), before the commit
        and the lock's release. A job that was itself promoted from the waiting set (a busy
        resource: others likely wait behind it) hands off now: the next job needs a few
        milliseconds to be dequeued and prepared by RQ, which overlap the commit and the
        release (it waits up to ``admission.HANDOFF_WAIT`` for the lock). Any other job's
        hand-off rides with its outcome's round trip in :func:`finish` (one round trip less
        per job; a job parked behind it meanwhile starts that commit and release later).
        See :mod:`django_joblock.admission`.
        """
        if self.admitted and not self.handed_off:
            self.handed_off = True
            if self.promoted:
                self.idle = admission.hand_off(self.job)

    def note_duration(self) -> None:
        """Count a worker's run that took ``ALERTS["TIMEOUT_RATIO"]`` or more of its RQ
        ``job_timeout`` (metric ``near_timeout``; a run RQ's timeout killed counts too, since
        its ``JobTimeoutException`` unwinds through the run)."""
        timeout = getattr(self.job, "timeout", None)
        if not self.worker or not isinstance(timeout, (int, float)) or timeout <= 0:
            return
        if time.monotonic() - self.began >= conf.get().ALERTS["TIMEOUT_RATIO"] * timeout:
            metrics.count("near_timeout", self.family, self.spec.name)

    def started(self) -> None:
        """The run took its lock (or needs none): record the wait since enqueue."""
        if self.job is None or self.waited is not None:
            return
        created = getattr(self.job, "created_at", None)
        if created is None:
            return
        self.waited = max(0.0, time.time() - created.timestamp())
        metrics.observe("start_wait_seconds", self.family, self.spec.name, self.waited)


def finish(run: Run, outcome: JobOutcome, **extra: Any) -> None:
    """Record ``outcome`` in the job's meta and log the run's one line.

    One round trip on the queue's connection: the meta's ``HSET``, for a run with an
    idempotency key its entry in the key's delivery history (:mod:`django_joblock.deliveries`),
    for a run with a lock its span on the family's :mod:`~django_joblock.timeline`, and, when
    nobody waited on the resource, the removal of its rate-limit keys
    (:func:`admission.forget_if_idle`). A failed run (it raised) by a worker counts
    ``failed_runs``, and ``rq_retries`` when RQ retries it.
    """
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
    commands: list[list[Any]] = [["HSET", job.key, "meta", job.serializer.dumps(job.meta)]]
    if run.worker and (run.key is not None or run.resource is not None):
        # One entry: the key's delivery history and the family's timeline share it.
        twin = str(extra.get("duplicate_of", ""))
        delivery = deliveries.entry(
            job, outcome.value, run.began, run.waited, resource=run.resource, duplicate_of=twin
        )
        if run.key is not None:
            commands += deliveries.add_commands(run.spec.scope, run.key, delivery)
        if run.resource is not None:
            commands += timeline.add_commands(run.family, timeline.Span.of(delivery, run.spec.name))
    if run.idle is not None:
        commands.append(admission.forget_if_idle(run.idle))
    # A hand-off decided but not sent yet (Run.hand_off) rides along.
    deferred = run.handed_off and not run.promoted
    hand_off = admission.hand_off_commands(job) if deferred else []
    try:
        # The lean path: one round trip without redis-py's pipeline machinery (about half
        # this step's client-side cost). Not sent twice: an RPUSH must not repeat.
        replies = lean.execute_many(job.connection, [*hand_off, *commands], retry=False)
        if hand_off and not isinstance(replies[0], ResponseError):
            admission.handed_off(job)
        refused = [reply for reply in replies if isinstance(reply, ResponseError)]
        if refused:
            raise refused[0]
    except REDIS_ERRORS:
        logger.warning(
            "could not record outcome %s in the meta of job %s",
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

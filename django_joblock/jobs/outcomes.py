"""How one run of a ``@locked_job`` ends (:func:`finish`; docs/jobs.md, "Outcomes"): its
:class:`JobOutcome`, ``reason`` and ``waited`` go to ``job.meta["joblock"]``, written after the
job's commit with its :mod:`.history` entry in one round trip (only our key: meta written by others
stays; a failed write is logged, never a job failure), and it logs **one** line on
``django_joblock`` (INFO; DEBUG inline): ``job <id> <outcome>: <function> resource= key=``.
When the lock's Redis is the job's (same server and database), that round trip is the lock's
release: a job's end costs one round trip, not two."""

from __future__ import annotations

import enum
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from .. import conf, metrics
from ..backend import REDIS_ERRORS, Call, Script, client, send
from ..exceptions import LockBackendUnavailable
from ..locks.info import HOST
from ..locks.lock import Lock
from ..logs import logger
from . import history
from .queues import server_of
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


# Our key written in one round trip over a stored meta that is still what this process holds
# (the usual case); else (written meanwhile, or serialized otherwise) merged into it by _write.
_SWAP_META = Script(
    """
-- Replace an RQ job's serialized meta if it is still the one expected.
-- KEYS[1] the RQ job hash
-- ARGV[1] the meta expected (serialized; "" for none: RQ stores no empty meta), ARGV[2] the new
-- Returns 1 replaced, 0 left as it was (another meta, or no job).
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if (redis.call('HGET', KEYS[1], 'meta') or '') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'meta', ARGV[2])
return 1
"""
)

# These runs raised: RQ fails the job, or retries it when its Retry has retries left.
RAISED = frozenset({JobOutcome.FAILED, JobOutcome.ABORTED, JobOutcome.GAVE_UP})


@dataclass
class Run:
    """One run of a job: ``job`` is None inline; ``worker``: it can requeue (no sync queue)."""

    spec: JobSpec[Any, Any]
    resource: str | None
    key: str | None
    job: Any
    worker: bool
    holder: str = ""  # who held the resource, when it was busy (for the log line)
    waited: float | None = None
    began: float = field(default_factory=time.monotonic)
    held: Lock | None = None  # the run's lock until released (by finish, else by the runner)

    def release(self, calls: list[Call]) -> list[Any] | None:
        """Release the run's lock (once), ``calls`` riding the release's round trip; their
        replies, or None when they were not sent (no lock held, or the release's Redis failed:
        logged, the lock then expires after its TTL)."""
        held = self.held
        self.held = None
        if held is None:
            return None
        try:
            return held.release_with(calls)[1]
        except LockBackendUnavailable:
            logger.warning("could not release %s: it expires by its TTL", held.key, exc_info=True)
            return None

    @property
    def family(self) -> str:
        """The metrics family: the resource's, else the idempotency key's (bounded)."""
        return history.family_of(self.resource or "", self.key or "")

    def note_duration(self) -> None:
        """Count ``near_timeout`` for a run near its RQ timeout (or killed by it: unwinds here)."""
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

    def delivery(self, outcome: JobOutcome, duplicate_of: str) -> history.Delivery:
        """This worker run's :mod:`.history` entry: it began at monotonic ``began`` and ends now."""
        took = time.monotonic() - self.began
        limit = getattr(self.job, "timeout", None)
        return history.Delivery(
            job_id=str(self.job.id),
            func=str(self.job.func_name or ""),
            key=self.key or "",
            resource=self.resource or "",
            worker=str(getattr(self.job, "worker_name", "") or ""),
            host=HOST,
            pid=os.getpid(),
            started=round(time.time() - took, 3),
            took=round(took, 3),
            outcome=outcome.value,
            waited=None if self.waited is None else round(self.waited, 3),
            duplicate_of=duplicate_of,
            timeout=float(limit) if isinstance(limit, (int, float)) and limit > 0 else None,
        )


def finish(run: Run, outcome: JobOutcome, **extra: Any) -> None:
    """Record ``outcome``, release the run's lock and log the run's line; count a worker's
    ``failed_runs``."""
    _log(run, outcome, extra)
    job = run.job
    if job is None:
        run.release([])
        return
    if outcome in RAISED and run.worker:
        metrics.count("failed_runs", run.family, run.spec.name)
        if (getattr(job, "retries_left", None) or 0) > 0:  # RQ retries it next
            metrics.count("rq_retries", run.family, run.spec.name)
    # What RQ stored, unless another process wrote it (an empty meta RQ does not store).
    held = job.serializer.dumps(job.meta) if job.meta else b""
    state = job.meta.setdefault("joblock", {})
    state["outcome"] = outcome.value
    if "reason" not in extra:
        state.pop("reason", None)  # a reason from an earlier requeue no longer applies
    if outcome is not JobOutcome.REQUEUED:
        state.pop("first_contended", None)  # a wait for the lock ended: a retry's has its max_wait
    if run.waited is not None:
        state["waited"] = round(run.waited, 6)
    state.update(extra)
    calls: list[Call] = []
    if run.worker and (run.key is not None or run.resource is not None):
        calls += history.add_calls(run.delivery(outcome, str(extra.get("duplicate_of", ""))))
    calls.insert(0, (_SWAP_META, [job.key], [held, job.serializer.dumps(job.meta)]))
    replies = None
    if run.held is not None and server_of(client(run.held.cache)) == server_of(job.connection):
        replies = run.release(calls)
    run.release([])  # (if not released above) the lock first, as when they ride together
    try:
        if replies is None:
            replies = send(job.connection, calls)
        if replies[0] != 1:
            job.connection.transaction(lambda pipe: _write(pipe, job, state), job.key)
    except REDIS_ERRORS:
        fields = {"job_id": job.id, "outcome": outcome.value}
        message = "could not record outcome %s of job %s"
        logger.warning(message, outcome.value, job.id, exc_info=True, extra=fields)


def _write(pipe: Any, job: Any, state: dict[str, Any]) -> None:
    """Our key merged into the stored ``job.meta``, read under ``WATCH``: others' writes stay;
    meta we cannot read is not ours to overwrite."""
    stored = pipe.hget(job.key, "meta")
    try:
        meta = job.serializer.loads(stored) if stored else {}
    except Exception:  # noqa: BLE001 (any serializer's error): left to its writer
        meta = None
    pipe.multi()
    if isinstance(meta, dict):
        pipe.hset(job.key, "meta", job.serializer.dumps({**meta, "joblock": state}))


def _log(run: Run, outcome: JobOutcome, extra: dict[str, Any]) -> None:
    level = logging.INFO if run.job is not None else logging.DEBUG
    if not logger.isEnabledFor(level):
        return
    job_id = getattr(run.job, "id", None)
    reason = extra.get("reason", "")
    parts = [run.spec.name, f"resource={run.resource or '-'}", f"key={run.key or '-'}"]
    if run.holder:
        parts.append(f"holder={run.holder}")
    if outcome is JobOutcome.REQUEUED:
        parts.append(f"in {extra.get('delays', [0])[-1]}s (requeue {extra.get('requeues')})")
    if run.waited is not None and outcome in (JobOutcome.RAN, JobOutcome.REPLAYED):
        parts.append(f"waited {run.waited:.3f}s")
    if reason:
        parts.append(f"reason: {reason}")
    fields = {
        "job_id": job_id,
        "resource": run.resource,
        "idempotency_key": run.key,
        "reason": reason,
        "outcome": outcome.value,
        "holder": run.holder,
        "waited": run.waited,
    }
    logger.log(level, "job %s %s: %s", job_id or "(inline)", outcome, " ".join(parts), extra=fields)

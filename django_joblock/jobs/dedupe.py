"""Duplicates stopped at enqueue, ``@locked_job(..., dedupe=True)`` (docs/jobs.md): the RQ id
is ``joblock-<40 hex of sha256>`` of the dotted name and idempotency key, and ``.delay()`` of a
logical job whose RQ job is *live* returns it (with other arguments: raises
:class:`IdempotencyKeyMismatch`, as the run would); one that ended (or expired) is enqueued again
and its record replays. Check-and-enqueue is atomic per id through a guard key on the queue's
connection (compare-and-delete; ``GUARD_TTL``): three more round trips, none at run time."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from typing import Any

from rq.job import JobStatus

from .. import conf, metrics
from ..backend import Script
from ..exceptions import IdempotencyKeyMismatch, JoblockError
from ..logs import logger

# RQ statuses of a job that is still going to run (or running). rq 2.x lacks "rate_limited".
LIVE = frozenset({"created", "queued", "started", "deferred", "scheduled", "rate_limited"})
GUARD_TTL = 10.0  # seconds an enqueuer may hold the guard of one job id
_POLL = 0.01

_RELEASE_GUARD = Script(
    """
-- Release an enqueue guard we hold (compare-and-delete: it may have expired and been retaken
-- by another enqueuer, whose guard a blind DEL would remove).
-- KEYS[1] guard key
-- ARGV[1] our token
-- Returns 1 released, 0 not ours (any more).
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
)


def job_id_for(scope: str, key: str) -> str:
    """The RQ job id of the logical job ``key`` of the job named ``scope``."""
    return "joblock-" + hashlib.sha256(f"{scope}\x00{key}".encode()).hexdigest()[:40]


def _status(queue: Any, job_id: str) -> str | None:
    raw = queue.connection.hget(queue.job_class.key_for(job_id), "status")
    return raw.decode() if isinstance(raw, bytes) else raw


def enqueue_once(
    queue: Any,
    job_id: str,
    enqueue: Callable[[], Any],
    same_call: Callable[[Any], bool],
    *,
    family: str,
    func: str,
) -> Any:
    """``enqueue()`` unless job ``job_id`` is live on ``queue``: then that job if
    ``same_call(job)`` (module docs), else :class:`IdempotencyKeyMismatch`."""
    client = queue.connection
    guard = f"{conf.get().KEY_PREFIX}:enqueue:{job_id}"
    token = secrets.token_hex(8)
    deadline = time.monotonic() + 2 * GUARD_TTL
    while True:
        if client.set(guard, token, nx=True, px=int(GUARD_TTL * 1000)):
            try:
                status = _status(queue, job_id)
                if status not in LIVE:
                    if status is not None:
                        _forget_last_end(queue, job_id, status)
                    return enqueue()
                existing = queue.fetch_job(job_id)
            finally:
                _RELEASE_GUARD(client, [guard], [token])
        else:
            existing = queue.fetch_job(job_id) if _status(queue, job_id) in LIVE else None
        if existing is not None and existing.get_status(refresh=False) in LIVE:
            if not same_call(existing):
                key = existing.meta.get("joblock", {}).get("idempotency_key")
                raise IdempotencyKeyMismatch(
                    f"{func}: idempotency key {key!r} is live as job {existing.id} with other "
                    "arguments; not enqueued (the job's run would refuse them too)",
                    key=key,
                )
            metrics.count("blocked_at_enqueue", family, func)
            metrics.flush_now()  # an enqueuing web process may never flush otherwise
            fields = {"job_id": existing.id, "outcome": "blocked_at_enqueue", "reason": "live job"}
            line = "duplicate .delay() of %s blocked at enqueue: job %s is %s"
            logger.info(line, func, existing.id, existing.get_status(refresh=False), extra=fields)
            return existing
        if time.monotonic() > deadline:
            raise JoblockError(
                f"Could not enqueue job {job_id} of {func}: another process kept its enqueue "
                f"guard {guard!r} for {2 * GUARD_TTL:g}s."
            )
        time.sleep(_POLL)


def _forget_last_end(queue: Any, job_id: str, status: str) -> None:
    """Job ``job_id`` ended and runs again under its id: drop its old registry entry and its
    hash, and ``PERSIST`` its dependency keys, as RQ's enqueue keeps the expiry its end gave
    them (``result_ttl``...). RQ's enqueue writes the fields the new job has over the old hash
    and keeps the others: a ``retry=`` of the earlier call would give the new job its retries,
    an earlier failure its ``exc_info``. Its results (RQ's own key) stay."""
    if status in (JobStatus.FAILED, JobStatus.STOPPED):  # RQ keeps a stopped job as failed
        queue.failed_job_registry.remove(job_id)
    elif status == JobStatus.FINISHED:
        queue.finished_job_registry.remove(job_id)
    elif status == JobStatus.CANCELED:
        queue.canceled_job_registry.remove(job_id)
    old = queue.job_class(id=job_id, connection=queue.connection)
    pipe = queue.connection.pipeline(transaction=False)
    pipe.delete(old.key)
    for key in (old.dependents_key, old.dependencies_key):
        pipe.persist(key)
    pipe.execute()

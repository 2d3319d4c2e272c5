"""A slot follows its lock (docs/jobs.md, "When the slot frees"): a parked job never waits on a
holder that is gone for longer than that holder's lock TTL and one sweep interval.

A job's lock is its work horse's heartbeat: renewed every TTL / 3 while the horse runs, its
active-lock index entry (:mod:`..locks.index`) scored by its expiry. An entry whose score has
passed while its lock hash is gone (or another owner's) is a holding that ended *without* a
release: the horse was killed with its worker, stopped past its TTL, or cut off from Redis.
:func:`sweep` then frees that job's admission slot through RQ's public
``RateLimitRegistry.release_and_enqueue`` (RQ pushes the oldest parked job onto its queue)
and removes the entry, whatever state RQ's maintenance lock, scheduler or started registry
are in. The dead job itself stays RQ's to settle: "started" until RQ's maintenance fails it
(``AbandonedJobError``) or retries it, visibly; RQ's own release of its slot then finds
nothing to free. A stopped horse that wakes up finds its lock lost and aborts (the fence
refuses its writes meanwhile).

The workers of :mod:`django_joblock.worker` sweep every :data:`INTERVAL` seconds while idle,
one at a time: a sweeper takes ``<prefix>:sweep`` for one interval (``SET NX PX``; a dead
sweeper delays the next sweep by one interval at most). An entry of a job that is not on the
sweeping worker's Redis is left for the workers of that job's server, and forgotten after
:data:`FORGET_AFTER` seconds (its job was deleted). A sweep costs three round trips when nothing
expired (its turn, the families, their expired entries), one per step more otherwise.

A lock whose job's work horse has exited without releasing it (RQ's stop-job command,
``job_timeout``, the OOM killer) is released by the worker that watched the horse
(:func:`release_ended`), at once rather than at its expiry.
"""

from __future__ import annotations

import time
from typing import Any

from rq.job import Job

from .. import conf
from ..backend import client, text
from ..locks import index, waiting
from ..locks.info import LockHash
from ..locks.keys import LockKeys, owner_hash
from ..locks.scripts import Outcome
from ..logs import logger
from .admission import supported

INTERVAL = 1.0  # seconds between two sweeps (of any worker)
LIMIT = 100  # expired entries looked at per family and sweep
FORGET_AFTER = 600.0  # seconds after its expiry an entry of a job found nowhere is dropped


def _sweep_key() -> str:
    return f"{conf.get().KEY_PREFIX}:sweep"


def claim_turn() -> bool:
    """Take the next sweep for this process (one ``SET NX PX``): False while another process
    swept less than :data:`INTERVAL` ago."""
    found = client(conf.get().REDIS_ALIAS)
    return bool(found.set(_sweep_key(), 1, nx=True, px=int(INTERVAL * 1000)))


def sweep(queue_connection: Any) -> list[index.Member]:
    """Free the admission slots, on ``queue_connection`` (the Redis of the caller's queues), of
    the jobs whose lock ended without a release, and remove their index entries (and those of
    plain ``lock()`` holders that died). Returns the entries removed. Redis errors propagate."""
    settings = conf.get()
    found = index.expired(index.families(), LIMIT)
    if not found:
        return []
    locks = client(settings.REDIS_ALIAS)
    pipe = locks.pipeline(transaction=False)
    for entry in found:
        pipe.hget(LockKeys(settings.KEY_PREFIX, entry.resource).lock, "token")
    tokens = pipe.execute()
    gone = [
        entry
        for entry, token in zip(found, tokens, strict=True)
        # Still this holder's: its renewals are late (or its clock is), it is not gone.
        if token is None or owner_hash(text(token)) != entry.owner
    ]
    jobs = [entry for entry in gone if entry.job_id]
    pipe = queue_connection.pipeline(transaction=False)
    for entry in jobs:
        pipe.exists(Job.key_for(entry.job_id))
    here = dict(zip((entry.job_id for entry in jobs), pipe.execute(), strict=True)) if jobs else {}
    forget_before = (time.time() - FORGET_AFTER) * 1000
    done = []
    for entry in gone:
        if entry.job_id and not here[entry.job_id]:
            if entry.expires_ms < forget_before:
                done.append(entry)
            continue  # a job of another server's queues: its workers free its slot
        if entry.job_id and supported():
            _free_slot(queue_connection, settings.KEY_PREFIX, entry)
        done.append(entry)
    index.drop(done)
    return done


def _free_slot(queue_connection: Any, prefix: str, entry: index.Member) -> None:
    from rq.rate_limit import RateLimitRegistry  # rq >= 3.0 (supported() said so)

    key = LockKeys(prefix, entry.resource).lock  # admission's RateLimit key
    promoted = RateLimitRegistry(key, queue_connection).release_and_enqueue(entry.job_id)
    logger.warning(
        "job %s held %s and its lock expired without a release (its worker died, stopped or "
        "lost Redis): its admission slot is freed%s; RQ settles the job itself",
        entry.job_id,
        entry.resource,
        f", job {', '.join(promoted)} starts next" if promoted else "",
        extra={"job_id": entry.job_id, "resource": entry.resource, "outcome": "slot_freed"},
    )


def release_ended(resource: str, job_id: str) -> bool:
    """Release ``resource``'s lock if RQ job ``job_id`` holds it, once that job's work horse has
    exited: a lock it still holds is then a dead holding (the horse was killed). The holder's
    own release, with its token read from the lock (it hands the lock to the first waiter);
    nothing if the lock changed hands. One round trip, two when it releases. Redis errors
    propagate."""
    locks = client(conf.get().REDIS_ALIAS)
    keys = LockKeys(conf.get().KEY_PREFIX, resource)
    found = LockHash.decode(locks.hgetall(keys.lock))
    if found is None or found.job_id != job_id:
        return False
    unindex = index.remove_call(keys.prefix, resource, found.owner, job_id)
    released = waiting.release(locks, keys, found.token, "", [unindex]) is Outcome.OK
    if released:
        fields = {"job_id": job_id, "resource": resource, "outcome": "released_for_dead_horse"}
        message = "job %s's work horse exited holding %s: its lock is released"
        logger.warning(message, job_id, resource, extra=fields)
    return released

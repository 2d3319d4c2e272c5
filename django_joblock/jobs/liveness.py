"""A slot follows its lock (docs/jobs.md, "When the slot frees"): a parked job never waits on a
holder that is gone for longer than that holder's lock TTL and one sweep interval.

A job's lock is its work horse's heartbeat, its active-lock index entry (:mod:`..locks.index`)
scored by its expiry. An entry whose score has passed while its lock hash is gone (or another
owner's) is a holding that ended *without* a release (the horse was killed with its worker,
stopped past its TTL, or cut off from Redis): :func:`sweep` frees that job's admission slot with
RQ's public ``RateLimitRegistry.release_and_enqueue`` and removes the entry, whatever state RQ's
maintenance lock, scheduler or started registry are in. The dead job stays RQ's to settle; a
stopped horse that wakes up finds its lock lost and aborts (the fence refuses its writes).

The workers of :mod:`django_joblock.worker` sweep every :data:`INTERVAL` seconds while idle, one at
a time per queue Redis (``<prefix>:sweep:<queue Redis>``, ``SET NX PX`` for one interval: a dead
sweeper delays the next sweep by one interval at most). An entry of a job not on the sweeping
worker's Redis is left to that job's workers, and forgotten after :data:`FORGET_AFTER` seconds
(its job was deleted). A sweep costs three round trips when nothing expired. A lock whose job's
horse exited holding it is released at once by the worker that watched the horse
(:func:`release_ended`)."""

from __future__ import annotations

import hashlib
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
from .queues import server_of

INTERVAL = 1.0  # seconds between two sweeps (of any worker)
LIMIT = 100  # expired entries looked at per family and sweep
FORGET_AFTER = 600.0  # seconds after its expiry an entry of a job found nowhere is dropped


def claim_turn(queue_connection: Any) -> bool:
    """Take the next sweep for the queues on ``queue_connection``'s Redis (one ``SET NX PX`` on
    the locks' Redis): False if another worker of those queues swept within INTERVAL. Each queue
    Redis (server and database) has its own turn: a sweep frees the slots of its own queues'
    jobs only, so a worker of other queues taking the turn would leave these parked."""
    server = hashlib.sha256(repr(server_of(queue_connection)).encode()).hexdigest()[:16]
    turn = f"{conf.get().KEY_PREFIX}:sweep:{server}"
    return bool(client().set(turn, 1, nx=True, px=int(INTERVAL * 1000)))


def sweep(queue_connection: Any) -> list[index.Member]:
    """Free the admission slots, on ``queue_connection`` (the Redis of the caller's queues), of
    the jobs whose lock ended without a release, and remove their index entries (and those of
    plain ``lock()`` holders that died). Returns the entries removed. Redis errors propagate."""
    settings = conf.get()
    found = index.expired(index.families(), LIMIT)
    if not found:
        return []
    pipe = client().pipeline(transaction=False)
    for entry in found:
        pipe.hget(entry.key, "token")
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
    message = (
        "job %s held %s and its lock expired without a release (its worker died, stopped "
        "or lost Redis): its admission slot is freed%s; RQ settles the job itself"
    )
    next_job = f", job {', '.join(promoted)} starts next" if promoted else ""
    fields = {"job_id": entry.job_id, "resource": entry.resource, "outcome": "slot_freed"}
    logger.warning(message, entry.job_id, entry.resource, next_job, extra=fields)


def release_ended(resource: str, job_id: str, worker: str, limit: int = 1) -> bool:
    """Release ``resource``'s lock (the slot it holds, of a lock with ``limit`` slots) if RQ job
    ``job_id``'s run on ``worker`` (its work horse has exited: killed) still holds it, as the
    holder would, with the lock's token (it hands the lock to the first waiter); never a run of
    the same job on another worker (a retry, a re-delayed ``dedupe`` job). One round trip, two
    when it releases; Redis errors propagate."""
    locks = client()
    keys = LockKeys(conf.get().KEY_PREFIX, resource)
    holding = _held_by(locks, keys, limit, job_id, worker)
    if holding is None:
        return False
    slot, found = holding
    keys = keys.at(slot)
    unindex = index.remove_call(keys.prefix, resource, found.owner, job_id, slot)
    released = waiting.release(locks, keys, found.token, "", [unindex])[0] is Outcome.OK
    if released:
        fields = {"job_id": job_id, "resource": resource, "outcome": "released_for_dead_horse"}
        message = "job %s's work horse exited holding %s: its lock is released"
        logger.warning(message, job_id, resource, extra=fields)
    return released


def _held_by(
    locks: Any, keys: LockKeys, limit: int, job_id: str, worker: str
) -> tuple[int, LockHash] | None:
    """The slot (of ``limit``) and lock hash ``job_id``'s run on ``worker`` holds, if any: the
    slots are read in one round trip."""
    pipe = locks.pipeline(transaction=False)
    for slot in range(limit):
        pipe.hgetall(keys.slot_key(slot))
    for slot, raw in enumerate(pipe.execute()):
        found = LockHash.decode(raw)
        if found is not None and (found.job_id, found.worker) == (job_id, worker):
            return slot, found
    return None

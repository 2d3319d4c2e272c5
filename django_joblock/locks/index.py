"""The active-lock index and the families set: the one module that encodes and reads them.

- ``P:active:<family>`` (ZSET): one member ``resource#owner`` (``resource#owner#job_id``
  for an RQ job's lock; ``resource#owner#job_id#slot`` for slot 1 or more of a lock with a
  limit) per holding, scored by its expiry (Unix ms). The ACQUIRE script
  writes it and RELEASE removes it (on Redis Cluster, and after a wait in line, a round trip
  of its own follows them, best effort: another node's outage never fails a lock); every
  renewal refreshes its score, in the RENEW script when it renewed (on Redis Cluster, in a
  round trip of its own). An entry whose score passed proves that its holding ended without a
  release: readers skip it, and only the liveness sweep (:mod:`django_joblock.jobs.liveness`)
  removes it, after freeing the job's admission slot. Readers drop unexpired entries of
  lock-only holdings whose lock hash is gone or someone else's.
- ``P:families`` (SET): the families that have entries, added with every acquire and renewal
  (so it comes back after a ``FLUSHDB``), pruned by :func:`active_counts` when a family has no
  entry left.

Members are per owner, so removing ours never removes the next holder's entry. No ``KEYS``,
no ``SCAN``: a reader walks the families set and, per family, at most the entries it shows.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, NamedTuple

from .. import conf
from ..backend import client, is_cluster, text
from . import keys

# (resource, owner, ttl in seconds, RQ job id or "", slot of a lock with a limit, else 0)
Entry = tuple[str, str, float, str, int]


class Member(NamedTuple):
    """One index entry, decoded."""

    family: str
    resource: str
    owner: str
    job_id: str
    expires_ms: int  # the score: the holding's expiry (Unix ms, by its holder's clock)
    slot: int = 0  # which lock hash of the resource the holding has (lock(limit=N))

    @property
    def key(self) -> str:
        """The lock hash of this holding, under the settings' key prefix."""
        return keys.LockKeys(conf.get().KEY_PREFIX, self.resource, self.slot).lock


def _index_key(prefix: str, family: str) -> str:
    return f"{prefix}:active:{family}"


def families_key(prefix: str) -> str:
    return f"{prefix}:families"


def member(resource: str, owner: str, job_id: str = "", slot: int = 0) -> str:
    """The index member of one holding (a resource has no ``#``; neither has an RQ job id)."""
    if slot:
        return f"{resource}#{owner}#{job_id}#{slot}"
    return f"{resource}#{owner}#{job_id}" if job_id else f"{resource}#{owner}"


def add_calls(prefix: str, entries: Iterable[Entry]) -> list[list[Any]]:
    """Commands that (re)index holdings by expiry: a ``ZADD`` per family, a ``SADD`` of them."""
    now_ms = time.time() * 1000
    scores: dict[str, list[Any]] = {}
    for resource, owner, ttl, job_id, slot in entries:
        scores.setdefault(keys.family(resource), []).extend(
            (int(now_ms + ttl * 1000), member(resource, owner, job_id, slot))
        )
    calls: list[list[Any]] = [
        ["ZADD", _index_key(prefix, family), *pairs] for family, pairs in scores.items()
    ]
    if scores:
        calls.append(["SADD", families_key(prefix), *scores])
    return calls


def in_script(found: Any, prefix: str, entry: Entry) -> tuple[list[str], list[Any]]:
    """The entry as extra KEYS and ARGV of ACQUIRE or RENEW, which then write it (one command:
    cheaper than a pipeline; RENEW only if it renewed); its first KEYS and ARGV[2] let RELEASE
    remove it. ``([], [])`` on Redis Cluster (the index is in other slots): :func:`add_calls`
    and :func:`remove_call` instead."""
    if is_cluster(found):
        return [], []
    resource, owner, ttl, job_id, slot = entry
    family = keys.family(resource)
    score = int(time.time() * 1000 + ttl * 1000)
    index_keys = [_index_key(prefix, family), families_key(prefix)]
    return index_keys, [score, member(resource, owner, job_id, slot), family]


def in_release(found: Any, prefix: str, entry: Entry) -> tuple[list[str], list[Any]]:
    """The index key and member of ``entry`` that RELEASE removes (as extra KEYS and ARGV);
    ``([], [])`` on Redis Cluster (:func:`remove_call` instead)."""
    if is_cluster(found):
        return [], []
    resource, owner, _ttl, job_id, slot = entry
    return [_index_key(prefix, keys.family(resource))], [member(resource, owner, job_id, slot)]


def in_wait_script(found: Any, prefix: str, entry: Entry) -> tuple[list[str], list[Any]]:
    """:func:`in_script` for WAIT, which picks the slot: the members of slot 0 and the start of
    another slot's member (the script appends the slot's number). ``([], [])`` on Redis
    Cluster."""
    if is_cluster(found):
        return [], []
    resource, owner, ttl, job_id, _slot = entry
    index_keys, (score, first, family) = in_script(found, prefix, (resource, owner, ttl, job_id, 0))
    return index_keys, [score, first, f"{resource}#{owner}#{job_id}#", family]


def scored_now(wait_args: list[Any], ttl_ms: int) -> list[Any]:
    """:func:`in_wait_script`'s ARGV with the score made afresh, for a WAIT sent now: a wait can
    outlast the TTL, and a holding WAIT takes expires ``ttl_ms`` after that WAIT, not after the
    wait began (an entry scored in the past reads as a holding that already ended)."""
    if not wait_args:
        return wait_args  # Redis Cluster: no index in WAIT
    return [int(time.time() * 1000) + ttl_ms, *wait_args[1:]]


def remove_call(
    prefix: str, resource: str, owner: str, job_id: str = "", slot: int = 0
) -> list[Any]:
    """The command that removes one holding's entry."""
    key = _index_key(prefix, keys.family(resource))
    return ["ZREM", key, member(resource, owner, job_id, slot)]


def families() -> list[str]:
    """The families with index entries (maybe expired ones), sorted."""
    return sorted(text(f) for f in client().smembers(families_key(conf.get().KEY_PREFIX)))


def _read(names: list[str], *, live: bool, limit: int = -1) -> list[list[Any]]:
    """Per family in ``names``, in one round trip: ``[unexpired count, entry count]``, or with
    ``limit`` up to that many unexpired (``live``) or expired entries and scores, oldest first."""
    prefix = conf.get().KEY_PREFIX
    now_ms = int(time.time() * 1000)
    low, high = (f"({now_ms}", "+inf") if live else ("-inf", now_ms)
    pipe = client().pipeline(transaction=False)
    for name in names:
        key = _index_key(prefix, name)
        if limit < 0:
            pipe.zcount(key, low, high)
            pipe.zcard(key)
        else:
            pipe.zrangebyscore(key, low, high, start=0, num=limit, withscores=True)
    replies = pipe.execute()
    return [replies[i : i + 2] for i in range(0, len(replies), 2)] if limit < 0 else replies


def active_counts() -> dict[str, int]:
    """Families holding locks now -> their unexpired entries. Families without any entry
    leave the families set (a renewal or acquire adds one back with its entry)."""
    names = families()
    replies = _read(names, live=True)
    idle = [name for name, (_, every) in zip(names, replies, strict=True) if not every]
    if idle:
        client().srem(families_key(conf.get().KEY_PREFIX), *idle)
    return {name: live for name, (live, _) in zip(names, replies, strict=True) if live}


def _decoded(names: list[str], replies: list[Any]) -> list[Member]:
    decoded = []
    for family, pairs in zip(names, replies, strict=True):
        for raw, score in pairs:
            # The inverse of member(): resource#owner[#job_id[#slot]].
            resource, owner, job_id, slot = [*text(raw).split("#"), "", ""][:4]
            slot_number = int(slot) if slot.isdigit() else 0
            decoded.append(Member(family, resource, owner, job_id, int(score), slot_number))
    return decoded


def members(names: list[str], limit: int) -> list[Member]:
    """Up to ``limit`` unexpired entries per family in ``names``, soonest to expire first."""
    return _decoded(names, _read(names, live=True, limit=limit))


def expired(names: list[str], limit: int) -> list[Member]:
    """Up to ``limit`` entries per family in ``names`` whose score (expiry by the holder's clock)
    has passed: holdings that ended without a release, or whose renewals are late. Oldest first."""
    return _decoded(names, _read(names, live=False, limit=limit))


def drop(stale: list[Member]) -> None:
    """Remove ``stale`` entries."""
    if stale:
        prefix = conf.get().KEY_PREFIX
        pipe = client().pipeline(transaction=False)
        for entry in stale:
            pipe.execute_command(
                *remove_call(prefix, entry.resource, entry.owner, entry.job_id, entry.slot)
            )
        pipe.execute()

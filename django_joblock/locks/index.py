"""The active-lock index and the families set: the one module that encodes and reads them.

- ``P:active:<family>`` (ZSET): one member ``resource#owner`` per holding, scored by its
  expiry (Unix ms). The ACQUIRE script writes it and RELEASE removes it (:func:`in_script`;
  on Redis Cluster, in the same pipeline: :func:`add_calls`, :func:`remove_call`); every
  renewal refreshes its score. A holder that dies leaves its entry until the score passes;
  readers prune expired entries and drop those whose lock hash is gone or someone else's
  (:func:`drop`).
- ``P:families`` (SET): the families that have entries, added with every acquire and renewal
  (so it comes back after a ``FLUSHDB`` or a restart without persistence), pruned by
  :func:`active_counts` when a family has no entry left.

Members are per owner, so removing ours never removes the next holder's entry. No ``KEYS``,
no ``SCAN``: a reader walks the families set and, per family, at most the entries it shows.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from .. import conf
from ..backend import client, is_cluster, text

Entry = tuple[str, str, float]  # (resource, owner, ttl in seconds)


def _index_key(prefix: str, family: str) -> str:
    return f"{prefix}:active:{family}"


def families_key(prefix: str) -> str:
    return f"{prefix}:families"


def member(resource: str, owner: str) -> str:
    """The index member of one holding (``owner`` is the token's short hash)."""
    return f"{resource}#{owner}"


def add_calls(prefix: str, entries: Iterable[Entry]) -> list[list[Any]]:
    """Commands that (re)index holdings, scored by their expiry: one ``ZADD`` per family, then
    one ``SADD`` of the families."""
    now_ms = time.time() * 1000
    scores: dict[str, list[Any]] = {}
    for resource, owner, ttl in entries:
        family = resource.split(":", 1)[0]
        scores.setdefault(family, []).extend((int(now_ms + ttl * 1000), member(resource, owner)))
    calls: list[list[Any]] = [
        ["ZADD", _index_key(prefix, family), *pairs] for family, pairs in scores.items()
    ]
    if scores:
        calls.append(["SADD", families_key(prefix), *scores])
    return calls


def in_script(found: Any, prefix: str, entry: Entry) -> tuple[list[str], list[Any]]:
    """The entry as extra KEYS and ARGV of the ACQUIRE script, which then writes it itself
    (one command, not a pipeline: cheaper per lock); the first KEYS and ARGV[2] of them serve
    RELEASE, to remove it. ``([], [])`` on Redis Cluster, where the index lives in other slots
    than the lock: there :func:`add_calls` and :func:`remove_call` ride in a pipeline."""
    if is_cluster(found):
        return [], []
    resource, owner, ttl = entry
    family = resource.split(":", 1)[0]
    score = int(time.time() * 1000 + ttl * 1000)
    return [_index_key(prefix, family), families_key(prefix)], [
        score,
        member(resource, owner),
        family,
    ]


def remove_call(prefix: str, resource: str, owner: str) -> list[Any]:
    """The command that removes one holding's entry."""
    return ["ZREM", _index_key(prefix, resource.split(":", 1)[0]), member(resource, owner)]


def _client() -> Any:
    return client(conf.get().REDIS_ALIAS)


def families() -> list[str]:
    """The families with index entries (maybe expired ones), sorted."""
    return sorted(text(f) for f in _client().smembers(families_key(conf.get().KEY_PREFIX)))


def _pruned(names: list[str], read: str, *args: Any) -> list[Any]:
    """Prune each family's expired entries and run ``read`` on its index, in one round trip."""
    prefix = conf.get().KEY_PREFIX
    now_ms = int(time.time() * 1000)
    pipe = _client().pipeline(transaction=False)
    for name in names:
        pipe.zremrangebyscore(_index_key(prefix, name), "-inf", now_ms)
        pipe.execute_command(read, _index_key(prefix, name), *args)
    return list(pipe.execute()[1::2])


def active_counts() -> dict[str, int]:
    """Families holding locks now -> their unexpired entries. Families left with none leave
    the families set (a renewal or acquire adds one back with its entry)."""
    names = families()
    found = dict(zip(names, (int(n) for n in _pruned(names, "ZCARD")), strict=True))
    idle = [name for name, count in found.items() if not count]
    if idle:
        _client().srem(families_key(conf.get().KEY_PREFIX), *idle)
    return {name: count for name, count in found.items() if count}


def members(names: list[str], limit: int) -> list[tuple[str, str, str]]:
    """``(family, resource, owner)`` of up to ``limit`` unexpired entries per family in
    ``names``, soonest to expire first."""
    found = []
    for name, raws in zip(names, _pruned(names, "ZRANGE", 0, limit - 1), strict=True):
        for raw in raws:
            resource, _, owner = text(raw).rpartition("#")
            found.append((name, resource, owner))
    return found


def drop(stale: list[tuple[str, str, str]]) -> None:
    """Remove entries ``(family, resource, owner)`` found not to match their lock hash."""
    if stale:
        prefix = conf.get().KEY_PREFIX
        pipe = _client().pipeline(transaction=False)
        for _name, resource, owner in stale:
            pipe.execute_command(*remove_call(prefix, resource, owner))
        pipe.execute()

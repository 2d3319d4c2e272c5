"""The active-lock index and the families set: the one module that writes and reads them.

Acquire and release stay one round trip each because the index is a *hint*, written late and
verified on read:

- ``P:active:<family>`` (ZSET): one member ``resource#owner`` per holding, scored by its expiry
  (Unix ms). The renewal thread adds a holding once it has been held ``INDEX_DELAY`` seconds and
  refreshes its score on every renewal (:func:`add_commands`, in the renewal's own round trip);
  its release removes it (:func:`remove_command`, in the release's round trip). A holder that
  dies leaves its entry until the score passes; readers prune expired entries
  (:func:`active_counts`, :func:`members`) and drop those whose lock hash is gone or someone else's
  (:func:`drop`).
- ``P:families`` (SET): the families that have entries. Added with every renewal batch (so it
  comes back after a ``FLUSHDB`` or a restart without persistence), pruned by :func:`active_counts`
  when a family has no entry left.

Members are per owner (``resource#owner-hash``), so removing our entry never removes the entry
of the next holder of the same resource. No ``KEYS``, no ``SCAN``: a reader walks the families
set and, per family, at most the entries it shows.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from . import conf
from .backend import connection, text
from .keys import active_index_key, families_key, family


def member(resource: str, owner: str) -> str:
    """The index member of one holding (``owner`` is the token's short hash)."""
    return f"{resource}#{owner}"


def parse_member(raw: Any) -> tuple[str, str]:
    """``(resource, owner)`` of an index member (bytes or str)."""
    resource, _, owner = text(raw).rpartition("#")
    return resource, owner


def add_commands(prefix: str, entries: Iterable[tuple[str, str, bytes, int]]) -> list[list[Any]]:
    """Commands that (re)index holdings: ``entries`` are ``(index key, family, member,
    expiry in Unix ms)``. One ``ZADD`` per family index, then one ``SADD`` of the families."""
    scores: dict[str, list[Any]] = {}
    families: set[str] = set()
    for key, family_name, encoded, expiry_ms in entries:
        scores.setdefault(key, []).extend((b"%d" % expiry_ms, encoded))
        families.add(family_name)
    commands: list[list[Any]] = [["ZADD", key, *pairs] for key, pairs in scores.items()]
    if families:
        commands.append(["SADD", families_key(prefix), *sorted(families)])
    return commands


def remove_command(index_key: str, resource: str, owner: str) -> list[Any]:
    """The command that removes one holding's entry (sent with its release)."""
    return ["ZREM", index_key, member(resource, owner)]


def _client() -> Any:
    return connection(conf.get().REDIS_ALIAS)


def families() -> list[str]:
    """The families with index entries (maybe expired ones), sorted."""
    return sorted(text(f) for f in _client().smembers(families_key(conf.get().KEY_PREFIX)))


def active_counts() -> dict[str, int]:
    """Families holding locks now -> their index entries not yet expired.

    Prunes expired entries, and forgets families left with none: the families set lists where
    to look, so a family whose last lock ended leaves it (and the dashboard, the Prometheus
    gauge) instead of staying forever. A renewal batch adds a family back with its entry, so a
    family pruned in the instant its first entry was written is missing for at most one
    heartbeat interval.
    """
    prefix = conf.get().KEY_PREFIX
    names = families()
    now_ms = int(time.time() * 1000)
    client = _client()
    pipe = client.pipeline(transaction=False)
    for fam in names:
        pipe.zremrangebyscore(active_index_key(prefix, fam), "-inf", now_ms)
        pipe.zcard(active_index_key(prefix, fam))
    replies = pipe.execute()
    found = {fam: int(replies[2 * i + 1]) for i, fam in enumerate(names)}
    idle = [fam for fam, n in found.items() if not n]
    if idle:
        client.srem(families_key(prefix), *idle)
    return {fam: n for fam, n in found.items() if n}


def members(names: list[str], limit: int) -> list[tuple[str, str, str]]:
    """``(family, resource, owner)`` of up to ``limit`` unexpired entries per family in
    ``names``, soonest to expire first (expired entries are pruned first)."""
    prefix = conf.get().KEY_PREFIX
    now_ms = int(time.time() * 1000)
    pipe = _client().pipeline(transaction=False)
    for fam in names:
        pipe.zremrangebyscore(active_index_key(prefix, fam), "-inf", now_ms)
        pipe.zrange(active_index_key(prefix, fam), 0, limit - 1)
    replies = pipe.execute()
    return [(fam, *parse_member(raw)) for i, fam in enumerate(names) for raw in replies[2 * i + 1]]


def indexed(holdings: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """Which ``(resource, owner)`` holdings have an unexpired index entry: one round trip (a
    reader that listed only some entries asks about the others here)."""
    if not holdings:
        return set()
    prefix = conf.get().KEY_PREFIX
    now_ms = int(time.time() * 1000)
    pipe = _client().pipeline(transaction=False)
    for resource, owner in holdings:
        pipe.zscore(active_index_key(prefix, family(resource)), member(resource, owner))
    scores = pipe.execute()
    return {
        holding
        for holding, score in zip(holdings, scores, strict=True)
        if score is not None and float(score) > now_ms
    }


def drop(stale: list[tuple[str, str, str]]) -> None:
    """Remove entries ``(family, resource, owner)`` found not to match their lock hash."""
    if not stale:
        return
    prefix = conf.get().KEY_PREFIX
    pipe = _client().pipeline(transaction=False)
    for fam, resource, owner in stale:
        pipe.zrem(active_index_key(prefix, fam), member(resource, owner))
    pipe.execute()

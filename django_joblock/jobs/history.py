"""The recent runs of each family (its resource's, else its idempotency key's), for the doctor and
the dashboard's timeline: a Redis LIST ``P:runs:<family>`` on the *queue's* connection gets one
:class:`Delivery` per worker run in its outcome round trip (:mod:`.outcomes`), keeps the last
:data:`KEPT` and expires :data:`TTL` s after its last write. Losing it loses history, never
correctness (the idempotency record stops a second effect)."""

from __future__ import annotations

import contextlib
import json
import math
from collections import Counter
from dataclasses import dataclass, fields
from typing import Any

from .. import conf
from ..backend import REDIS_ERRORS, Call, Script, text
from ..idempotency.inputs import key_family
from ..locks.keys import family

KEPT = 1000  # runs kept per family (the newest)
LAST_SECOND = 253402300799  # 9999-12-31 23:59:59 UTC, the last second datetime can show
RUN_MAX = 10 * 366 * 86400  # the longest run a history entry may claim (s)
TTL = 86400  # seconds a family's history lives after its last run


@dataclass(frozen=True)
class Delivery:
    """One run of a job: what it was about, who ran it, when, and how it ended."""

    job_id: str
    func: str
    key: str  # the idempotency key ("" without one)
    resource: str  # the resource its lock was on ("" without a lock)
    worker: str
    host: str
    pid: int | None
    started: float  # Unix seconds, the worker's clock
    took: float  # seconds from the run's start to its end
    outcome: str
    waited: float | None = None  # seconds from enqueue to the start
    duplicate_of: str = ""  # a duplicate in flight: the job it ran beside
    timeout: float | None = None  # the RQ job's job_timeout (seconds; None: none or unknown)

    @classmethod
    def decode(cls, raw: Any) -> Delivery | None:
        """An entry as stored, or None for one of an unexpected shape (another version)."""
        try:
            data = json.loads(text(raw))
            found = cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})
        except (ValueError, TypeError, KeyError):
            return None
        typed = all(_fits(getattr(found, f.name), str(f.type)) for f in fields(cls))
        if not typed or not 0 <= found.started <= LAST_SECOND or not 0 <= found.took <= RUN_MAX:
            return None  # a time no clock can show (1e308) would break every page showing it
        return found


def _fits(value: Any, declared: str) -> bool:
    """``value`` is of its field's declared type (``"float | None"``...): one odd entry must not
    break every page that shows the history. Numbers are finite, and never bools."""
    if value is None:
        return declared.endswith("| None")
    if declared.startswith("str"):
        return type(value) is str
    if declared.startswith("int"):
        return type(value) is int
    return type(value) in (int, float) and math.isfinite(value)


def family_of(resource: str, key: str) -> str:
    """The family whose history holds a run: its resource's, else its key's (bounded)."""
    return family(resource) if resource else key_family(key)


def _list_key(name: str) -> str:
    return f"{conf.get().KEY_PREFIX}:runs:{name}"


# One command, not RPUSH + LTRIM + EXPIRE: each command of a round trip costs the client more
# than the server's work here.
_APPEND = Script(
    """
-- Append a run to a family's history, keep the newest, expire the list after the last write.
-- KEYS[1] the history list
-- ARGV[1] the run (JSON), ARGV[2] how many runs to keep, ARGV[3] seconds to live
-- Returns the list's length.
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[2]), -1)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return redis.call('LLEN', KEYS[1])
"""
)


def add_calls(run: Delivery) -> list[Call]:
    """The command appending ``run`` to its family's history (sent with the job's outcome)."""
    name = _list_key(family_of(run.resource, run.key))
    # vars(): the fields as they are (all flat); asdict() would deep-copy them, per job.
    encoded = json.dumps(vars(run), separators=(",", ":"))
    return [(_APPEND, [name], [encoded, KEPT, TTL])]


def read(clients: list[Any], name: str, *, since: float = 0.0) -> list[Delivery]:
    """Family ``name``'s runs that ended after ``since`` (Unix s), from every client (one per
    queue server and database), by start; a silent Redis and an odd entry are left out."""
    raw: list[Any] = []
    for each in clients:
        with contextlib.suppress(*REDIS_ERRORS):
            raw += each.lrange(_list_key(name), 0, -1)
    found = [run for run in map(Delivery.decode, raw) if run and run.started + run.took >= since]
    return sorted(found, key=lambda run: (run.started, run.job_id))


def of_key(clients: list[Any], scope: str, key: str, resource: str = "") -> list[Delivery]:
    """The runs of idempotency ``key`` of the job ``scope`` (under ``resource``'s family)."""
    runs = read(clients, family_of(resource, key))
    return [run for run in runs if run.key == key and run.func == scope]


def summary(found: list[Delivery]) -> str:
    """One line: how many deliveries (distinct RQ job ids) and runs, and what each run did."""
    if not found:
        return ""
    outcomes = Counter(run.outcome for run in found)
    shown = ", ".join(f"{n} {name}" for name, n in sorted(outcomes.items()))
    return f"{len({run.job_id for run in found})} deliveries (RQ jobs), {len(found)} runs: {shown}"

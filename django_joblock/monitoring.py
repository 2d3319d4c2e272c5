"""Read-only queries shared by the admin, the commands, the Prometheus exporter and the alerts.

Nothing here uses ``KEYS`` or a whole-keyspace ``SCAN``: active locks come from the per-family
index ZSETs (expired entries pruned on read, each entry checked against its lock hash),
metrics from the per-minute bucket hashes of :mod:`django_joblock.metrics`.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from . import conf, metrics
from .backend import connection
from .keys import active_index_key, families_key, parse_index_member


def _client() -> Any:
    return connection(conf.get().REDIS_ALIAS)


def decode(value: Any) -> str:
    """A Redis reply (bytes or str) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


# -- metrics ---------------------------------------------------------------------------------
@dataclass
class Series:
    """Metric values summed over a window: ``counters[metric][(family, func)]`` and
    ``histograms[metric][(family, func)]`` = per-bucket counts (plus ``sums_us``)."""

    counters: dict[str, dict[tuple[str, str], int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )
    histograms: dict[str, dict[tuple[str, str], list[int]]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    sums_us: dict[str, dict[tuple[str, str], int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )

    def add(self, raw: dict[Any, Any]) -> None:
        for raw_field, raw_value in raw.items():
            name, family, func = decode(raw_field).split("|", 2)
            value = int(raw_value)
            metric, _, part = name.partition(":")
            label = (family, func)
            if not part:
                self.counters[metric][label] += value
            elif part == "sum_us":
                self.sums_us[metric][label] += value
            elif part.startswith("b"):
                counts = self.histograms[metric].setdefault(label, [0] * (len(metrics.BOUNDS) + 1))
                counts[int(part[1:])] += value

    def total(self, metric: str, family: str | None = None) -> int:
        return sum(
            v for (fam, _f), v in self.counters[metric].items() if family is None or fam == family
        )

    def merged_histogram(self, metric: str, family: str | None = None) -> list[int]:
        merged = [0] * (len(metrics.BOUNDS) + 1)
        for (fam, _func), counts in self.histograms[metric].items():
            if family is None or fam == family:
                merged = [a + b for a, b in zip(merged, counts, strict=True)]
        return merged

    def families(self) -> set[str]:
        found = {fam for per in self.counters.values() for fam, _ in per}
        found |= {fam for per in self.histograms.values() for fam, _ in per}
        return found


def percentile(counts: list[int], q: float) -> float | None:
    """Upper bound (seconds) of the bucket holding the ``q`` quantile (0..1); None if empty.

    Accurate to one bucket by construction; the +Inf bucket reports the last finite bound.
    """
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    running = 0
    for index, count in enumerate(counts):
        running += count
        if running >= rank and count:
            return metrics.BOUNDS[min(index, len(metrics.BOUNDS) - 1)]
    return metrics.BOUNDS[-1]


def window(seconds: float, now: float | None = None) -> Series:
    """Metrics summed over the last ``seconds`` (whole minutes, current one included)."""
    now = time.time() if now is None else now
    prefix = conf.get().KEY_PREFIX
    minutes = max(1, int(seconds // metrics.BUCKET_SECONDS) + 1)
    pipe = _client().pipeline(transaction=False)
    for back in range(minutes):
        pipe.hgetall(metrics.keys(prefix, now - back * metrics.BUCKET_SECONDS)[0])
    series = Series()
    for raw in pipe.execute():
        series.add(raw)
    return series


def per_minute(metric: str, minutes: int, now: float | None = None) -> list[tuple[int, int]]:
    """``[(minute_start, total)]`` of one counter, oldest first (for charts)."""
    now = time.time() if now is None else now
    prefix = conf.get().KEY_PREFIX
    starts = [int((now - back * metrics.BUCKET_SECONDS) // 60 * 60) for back in range(minutes)]
    pipe = _client().pipeline(transaction=False)
    for start in starts:
        pipe.hgetall(metrics.keys(prefix, start)[0])
    out = []
    for start, raw in zip(starts, pipe.execute(), strict=True):
        series = Series()
        series.add(raw)
        out.append((start, series.total(metric)))
    return list(reversed(out))


def totals() -> Series:
    """All-time totals (Prometheus counters)."""
    series = Series()
    series.add(_client().hgetall(metrics.keys(conf.get().KEY_PREFIX)[1]))
    return series


# -- active locks ----------------------------------------------------------------------------
@dataclass
class ActiveLock:
    resource: str
    family: str
    owner: str
    fence: int | None
    host: str
    pid: int | None
    job_id: str
    job_func: str
    worker: str
    acquired_ms: int | None
    renewed_ms: int | None
    renewals: int
    ttl_ms: int | None
    pttl_ms: int
    held_for: float
    token_hash: str
    # The lock server's clock (Unix ms, ``TIME``) when this row was read: acquired / renewed
    # times are compared with it, never with this machine's clock.
    read_ms: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_FAMILY_RE = re.compile(r"[A-Za-z0-9_.@/-]{1,200}\Z")


def validate_family(name: object) -> str:
    """``name`` if it can be a family (a resource's part before its first ``:``)."""
    if not isinstance(name, str) or not _FAMILY_RE.match(name):
        shown = repr(name)[:80]
        raise ValueError(
            f"Invalid family {shown}: 1 to 200 characters from A-Z a-z 0-9 _ . @ / - "
            "(the part of a resource before its first ':')."
        )
    return name


def families() -> list[str]:
    return sorted(decode(f) for f in _client().smembers(families_key(conf.get().KEY_PREFIX)))


def active_counts() -> dict[str, int]:
    """Families holding locks now -> their active locks (index entries not yet expired).

    Prunes expired index entries, and forgets families left with none: the families set
    lists where to look, so a family whose last lock ended leaves it (and the dashboard, the
    Prometheus gauge) instead of staying forever. A renewal batch adds a family back with its
    index entry, so a family pruned in the instant its first entry was written is missing for
    at most one heartbeat interval.
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
    counts = {fam: int(replies[2 * i + 1]) for i, fam in enumerate(names)}
    idle = [fam for fam, count in counts.items() if not count]
    if idle:
        client.srem(families_key(prefix), *idle)
    return {fam: count for fam, count in counts.items() if count}


def active_locks(
    family: str | None = None, limit: int = 500, total: int | None = None
) -> list[ActiveLock]:
    """Locks held right now, with their holders, longest-held first.

    At most ``limit`` per family and, with ``total``, about ``total`` overall (shared between
    the families), soonest-to-expire first within a family: the cost is bounded by what is
    shown, never by how many locks exist. Index entries whose lock hash is gone or owned by
    someone else are skipped (and pruned).
    """
    from .keys import LockKeys, owner_hash

    prefix = conf.get().KEY_PREFIX
    client = _client()
    names = [family] if family else families()
    if total is not None and names:
        limit = max(1, min(limit, -(-total // len(names))))
    now_ms = int(time.time() * 1000)
    pipe = client.pipeline(transaction=False)
    for fam in names:
        pipe.zremrangebyscore(active_index_key(prefix, fam), "-inf", now_ms)
        pipe.zrange(active_index_key(prefix, fam), 0, limit - 1)
    replies = pipe.execute()
    members = [(fam, decode(m)) for i, fam in enumerate(names) for m in replies[2 * i + 1]]
    if not members:
        return []
    pipe = client.pipeline(transaction=False)
    pipe.time()
    for _fam, member in members:
        resource, _owner = parse_index_member(member)
        key = LockKeys(prefix, resource).lock
        pipe.hgetall(key)
        pipe.pttl(key)
    clock, *details = pipe.execute()
    server_ms = int(clock[0]) * 1000 + int(clock[1]) // 1000
    found, stale = [], []
    for index, (fam, member) in enumerate(members):
        resource, owner = parse_index_member(member)
        raw = {decode(k): decode(v) for k, v in details[2 * index].items()}
        token = raw.get("token", "")
        if not token or owner_hash(token) != owner:
            stale.append((fam, member))
            continue
        acquired = int(raw["acquired_ms"]) if raw.get("acquired_ms") else None
        found.append(
            ActiveLock(
                resource=resource,
                family=fam,
                owner=owner,
                fence=_int(raw.get("fence")),
                host=raw.get("host", ""),
                pid=_int(raw.get("pid")),
                job_id=raw.get("job_id", ""),
                job_func=raw.get("job_func", ""),
                worker=raw.get("worker", ""),
                acquired_ms=acquired,
                renewed_ms=_int(raw.get("renewed_ms")),
                renewals=_int(raw.get("renewals")) or 0,
                ttl_ms=_int(raw.get("ttl_ms")),
                pttl_ms=int(details[2 * index + 1]),
                held_for=max(0.0, (server_ms - acquired) / 1000) if acquired else 0.0,
                token_hash=owner,
                read_ms=server_ms,
            )
        )
    if stale:
        pipe = client.pipeline(transaction=False)
        for fam, member in stale:
            pipe.zrem(active_index_key(prefix, fam), member)
        pipe.execute()
    found.sort(key=lambda lock: -lock.held_for)
    return found


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def record_active_sample(total: int, now: float | None = None) -> None:
    """Remember the active-lock count at ``now`` (for the 'growing without falling' alert)."""
    now = time.time() if now is None else now
    key = f"{conf.get().KEY_PREFIX}:{{metrics}}:active"
    keep = max(conf.get().ALERTS["ACTIVE_GROWTH"] * 2, 3600)
    pipe = _client().pipeline(transaction=False)
    pipe.zadd(key, {f"{now:.3f}:{total}": now})
    pipe.zremrangebyscore(key, "-inf", now - keep)
    pipe.expire(key, int(keep))
    pipe.execute()


def active_samples(since: float) -> list[tuple[float, int]]:
    key = f"{conf.get().KEY_PREFIX}:{{metrics}}:active"
    raw = _client().zrangebyscore(key, since, "+inf")
    out = []
    for member in raw:
        at, _, count = decode(member).partition(":")
        out.append((float(at), int(count)))
    return out


# -- scheduler -------------------------------------------------------------------------------
def requeueing_queues() -> dict[str, Any]:
    """Name -> queue of every queue a requeueing ``@locked_job`` uses. A queue whose name
    cannot be resolved is left out (system check E006 reports it), and so is a synchronous
    queue (``is_async=False``): its jobs run inline and never requeue."""
    from .exceptions import JoblockConfigError
    from .jobs import registered_jobs
    from .queues import get_queue, queue_name

    found: dict[str, Any] = {}
    for spec in registered_jobs():
        name = queue_name(spec.queue)
        if spec.on_conflict != "requeue" or name in found:
            continue
        try:
            queue = get_queue(spec.queue)
        except (JoblockConfigError, ValueError):
            continue
        if queue.is_async:
            found[name] = queue
    return found


def has_scheduler(queue: Any, client: Any = None) -> bool:
    """Does an RQ scheduler serve ``queue``? (RQ's scheduler lock, on the queue's connection
    or ``client``, a client on the same server.)"""
    from rq.scheduler import RQScheduler

    return bool((client or queue.connection).exists(RQScheduler.get_locking_key(queue.name)))


def queues_without_scheduler() -> list[str]:
    """Queues used by requeueing ``@locked_job`` functions that no RQ scheduler serves."""
    return [name for name, queue in requeueing_queues().items() if not has_scheduler(queue)]

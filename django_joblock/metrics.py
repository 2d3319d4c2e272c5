"""Counters and histograms in Redis, per family and job function (never per resource).

The owner of the metric structures: :data:`METRICS` is the one table (name, kind, help), read by
the recorder here and by the Prometheus exporter. Events go to a per-process buffer (no I/O on
the hot path), flushed by one Lua call (:data:`FLUSH`; both keys share the ``{metrics}`` hash
tag) into ``P:{metrics}:b:<minute>`` (expires after ``METRICS_RETENTION``: windows, rates,
percentiles) and ``P:{metrics}:total`` (all-time, for Prometheus). In an RQ job a flush rides
the lock release's round trip and ends every run (:func:`flush_now`), so a work horse that
``os._exit``\\ s loses nothing; an in-process worker's jobs wait for the next due flush instead
(:func:`jobs_flush_when_due`). Otherwise a release, or the renewal thread, flushes increments
once the oldest is ``FLUSH_INTERVAL`` s old (while a job holds its lock here,
``renewal.JOB_FLUSH_INTERVAL`` s: its release carries them), and so does the exit.

Fields: ``<metric>|<family>|<function>`` for a counter; ``<metric>:b<i>|...`` counts observations
in histogram bucket ``i`` (bounds :data:`BOUNDS`, in s), ``<metric>:sum_us|...`` sums them (µs)."""

from __future__ import annotations

import atexit
import bisect
import contextlib
import functools
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from . import conf
from .backend import REDIS_ERRORS, Call, Script, client, send, text

FLUSH = Script(
    """
-- Add buffered metric increments to the current time bucket and to the all-time totals.
-- KEYS[1] bucket hash, KEYS[2] totals hash (same {metrics} hash tag)
-- ARGV[1] bucket retention in seconds, then field, increment pairs
-- Returns the number of fields written.
for i = 2, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return (#ARGV - 1) / 2
"""
)


def bucket_key(prefix: str, minute: int) -> str:
    """The metric bucket of the minute starting at Unix time ``minute`` (a multiple of 60)."""
    return f"{prefix}:{{metrics}}:b:{minute}"


def totals_key(prefix: str) -> str:
    return f"{prefix}:{{metrics}}:total"


def samples_key(prefix: str) -> str:
    """Samples of the active-lock count, for the growth alert."""
    return f"{prefix}:{{metrics}}:active"


@dataclass(frozen=True)
class Metric:
    """One metric: its name in Redis and in code, its kind and its help text. Prometheus
    exports it as ``joblock_<exported or name>``, counters with ``_total``."""

    name: str
    kind: str  # COUNTER or HISTOGRAM
    help: str
    exported: str = ""


# The kinds (Prometheus' names).
COUNTER = "counter"
HISTOGRAM = "histogram"

# The one table: adding a metric is one line here (then record it with count()/observe()).
METRICS = (
    Metric("acquire_attempts", COUNTER, "Lock acquire calls."),
    Metric("acquired", COUNTER, "Acquire calls that got the lock."),
    Metric("contended", COUNTER, "Acquire calls that found the lock busy for the whole wait."),
    Metric("parked", COUNTER, "Jobs parked at enqueue behind a busy resource (admission)."),
    Metric("acquire_errors", COUNTER, "Acquire calls that failed because Redis was unavailable."),
    Metric("renewed", COUNTER, "Successful heartbeat renewals."),
    Metric("renew_failed", COUNTER, "Failed heartbeat renewals (timeouts, dropped connections)."),
    Metric("lost", COUNTER, "Locks lost while held (expired, taken, not renewed).", "locks_lost"),
    Metric("requeued", COUNTER, "Jobs requeued because their lock was busy."),
    Metric("given_up", COUNTER, "Jobs failed with LockContentionTimeout after REQUEUE_MAX_WAIT."),
    Metric("skipped", COUNTER, "Jobs skipped (on_conflict='skip') because their lock was busy."),
    Metric("duplicates_blocked", COUNTER, "Duplicate runs blocked by an idempotency record."),
    Metric("duplicates_in_flight", COUNTER, "Contended runs whose holder runs the same key."),
    Metric("blocked_at_enqueue", COUNTER, "Duplicate .delay() calls that returned the live job."),
    Metric("stale_fence_rejections", COUNTER, "Writes refused by fenced_update (StaleFence)."),
    Metric("near_timeout", COUNTER, "Job runs that took TIMEOUT_RATIO of their job_timeout."),
    Metric("failed_runs", COUNTER, "Job runs that raised: RQ fails or retries them."),
    Metric("rq_retries", COUNTER, "Failed job runs that RQ retries (retries left)."),
    Metric("forced_releases", COUNTER, "Locks released by an operator (admin or command)."),
    Metric("wait_seconds", HISTOGRAM, "Time spent waiting for a lock, until acquired or given up."),
    Metric("hold_seconds", HISTOGRAM, "Time a lock was held, acquire to release."),
    Metric("start_wait_seconds", HISTOGRAM, "Time from a job's enqueue to the start of its run."),
)
COUNTERS = frozenset(m.name for m in METRICS if m.kind == COUNTER)
HISTOGRAMS = frozenset(m.name for m in METRICS if m.kind == HISTOGRAM)

# Histogram bucket upper bounds (s); the last bucket is +Inf.
BOUNDS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    25.0,
    60.0,
    150.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
BUCKET_SECONDS = 60
FLUSH_INTERVAL = 1.0


def bucket_of(seconds: float) -> int:
    return bisect.bisect_left(BOUNDS, seconds)


def _minute(now: float) -> int:
    return int(now // BUCKET_SECONDS) * BUCKET_SECONDS


class Recorder:
    """This process's buffer of metric increments (``field -> increment``)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.pending: dict[str, int] = defaultdict(int)
        self.since = 0.0  # monotonic time the oldest increment in ``pending`` was added
        # Set while an in-process worker runs jobs (:func:`jobs_flush_when_due`).
        self.jobs_wait = False


_recorder = Recorder()


def _after_fork_in_child() -> None:
    global _recorder
    _recorder = Recorder()  # the parent's buffer is the parent's to flush


os.register_at_fork(after_in_child=_after_fork_in_child)


def enabled() -> bool:
    return bool(conf.get().METRICS)


def add(increments: dict[str, int]) -> None:
    """Add ``increments`` (``field -> n``) to this process's buffer: new events, or those whose
    flush failed, put back (they go out with the next one)."""
    with _recorder.lock:
        if not _recorder.pending:
            _recorder.since = time.monotonic()
        for name, n in increments.items():
            _recorder.pending[name] += n


def count(metric: str, family: str, func: str = "", n: int = 1) -> None:
    """Add ``n`` to counter ``metric`` of ``family`` / ``func`` (buffered)."""
    if metric not in COUNTERS:
        raise ValueError(f"{metric!r} is not a counter in django_joblock.metrics.METRICS")
    if enabled():
        add({f"{metric}|{family}|{func}": n})


@functools.lru_cache(maxsize=4096)
def _labelled(family: str, func: str, *names: str) -> tuple[str, ...]:
    """The fields ``<name>|<family>|<func>`` of ``names``, built once per label pair (a lock's
    acquire and release record several)."""
    return tuple(f"{name}|{family}|{func}" for name in names)


@functools.lru_cache(maxsize=4096)
def _histogram_fields(metric: str, family: str, func: str) -> tuple[tuple[str, ...], str]:
    """The bucket fields of histogram ``metric`` for one label pair, and its sum field."""
    buckets = _labelled(family, func, *(f"{metric}:b{i}" for i in range(len(BOUNDS) + 1)))
    return buckets, f"{metric}:sum_us|{family}|{func}"


def _observation(metric: str, family: str, func: str, seconds: float) -> dict[str, int]:
    buckets, total = _histogram_fields(metric, family, func)
    return {buckets[bucket_of(seconds)]: 1, total: int(seconds * 1e6)}


def observe(metric: str, family: str, func: str, seconds: float) -> None:
    """Record one observation of histogram ``metric`` (buffered)."""
    if metric not in HISTOGRAMS:
        raise ValueError(f"{metric!r} is not a histogram in django_joblock.metrics.METRICS")
    if enabled():
        add(_observation(metric, family, func, seconds))


def record_acquire(family: str, func: str, waited: float, *, acquired: bool) -> None:
    """One ``acquire()`` call's counters and wait time (buffered)."""
    if enabled():
        attempts, outcome = _labelled(
            family, func, "acquire_attempts", "acquired" if acquired else "contended"
        )
        add({attempts: 1, outcome: 1, **_observation("wait_seconds", family, func, waited)})


def pending() -> bool:
    return bool(_recorder.pending)


def take_for_flush(*, force: bool, interval: float = FLUSH_INTERVAL) -> dict[str, int]:
    """Remove and return the buffer when ``force``, or when its oldest increment is ``interval``
    s old (else ``{}``)."""
    with _recorder.lock:
        due = time.monotonic() - _recorder.since >= interval
        if not (force or (due and _recorder.pending)):
            return {}
        taken = dict(_recorder.pending)
        _recorder.pending = defaultdict(int)
    return taken


def flush_call(taken: dict[str, int], at: float | None = None) -> Call:
    """The :func:`~django_joblock.backend.send` call that adds ``taken`` to Redis, in the
    bucket of the minute of ``at`` (Unix seconds; default now)."""
    settings = conf.get()
    prefix = settings.KEY_PREFIX
    keys = [bucket_key(prefix, _minute(time.time() if at is None else at)), totals_key(prefix)]
    pairs = [value for item in taken.items() for value in item]
    return (FLUSH, keys, [int(settings.METRICS_RETENTION), *pairs])


def flush(make_client: Callable[[], Any], taken: dict[str, int], at: float | None = None) -> None:
    """Add ``taken`` (from :func:`take_for_flush`) to Redis, through the client
    ``make_client()`` returns, in the minute of ``at``; Redis trouble puts it back in the
    buffer, for the next flush."""
    try:  # a Redis Cluster client asks a node when made
        (reply,) = send(make_client(), [flush_call(taken, at)])
        if isinstance(reply, Exception):
            raise reply
    except REDIS_ERRORS:
        add(taken)


def flush_due() -> None:
    """Flush the buffer if its oldest increment is ``FLUSH_INTERVAL`` s old (else nothing)."""
    if enabled() and (taken := take_for_flush(force=False)):
        flush(client, taken)


def flush_at_job_end() -> bool:
    """Whether a job's run ends with a flush (its lock release carries it): yes, unless an
    in-process worker is running it (:func:`jobs_flush_when_due`). A work horse ``os._exit``\\ s
    after its job, so it must flush then."""
    return not _recorder.jobs_wait


@contextlib.contextmanager
def jobs_flush_when_due() -> Iterator[None]:
    """While an in-process worker (one that runs job after job in its own process, as
    :class:`~django_joblock.worker.JoblockSimpleWorker`) works: its jobs' metrics wait for the
    next due flush (a lock release's round trip once the oldest is ``FLUSH_INTERVAL`` s old,
    else the renewal thread or the worker, see :func:`flush_due`) instead of each job ending
    with one. Flushed when the block ends. A process forked meanwhile (a work horse) flushes
    at each job's end as before: its buffer is a new one."""
    _recorder.jobs_wait = True
    try:
        yield
    finally:
        _recorder.jobs_wait = False
        flush_now()


def flush_now(at: float | None = None) -> None:
    """Flush the buffer now, in this thread (the process may end next: at the end of every job
    run), into the minute of ``at`` (Unix seconds, default now); no round trip if empty."""
    if enabled() and (taken := take_for_flush(force=True)):
        flush(client, taken, at)


@atexit.register
def _flush_at_exit() -> None:
    if _recorder.pid == os.getpid() and _recorder.pending:
        with contextlib.suppress(Exception):  # interpreter shutdown: settings or Redis may be gone
            flush_now()


Labels = tuple[str, str]  # (family, function)


class Series:
    """Metric values summed over the Redis hashes ``raws``: ``counters[metric][(family, func)]``
    and ``histograms[metric][(family, func)]`` = per-bucket counts (plus ``sums_us``)."""

    def __init__(self, *raws: dict[Any, Any]) -> None:
        self.counters: dict[str, dict[Labels, int]] = defaultdict(lambda: defaultdict(int))
        self.histograms: dict[str, dict[Labels, list[int]]] = defaultdict(dict)
        self.sums_us: dict[str, dict[Labels, int]] = defaultdict(lambda: defaultdict(int))
        for raw in raws:
            self.add(raw)

    def add(self, raw: dict[Any, Any]) -> None:
        """Add one bucket's (or the totals') hash, as read from Redis."""
        for raw_field, raw_value in raw.items():
            name, family, func = text(raw_field).split("|", 2)
            value = int(raw_value)
            metric, _, part = name.partition(":")
            label = (family, func)
            if not part:
                self.counters[metric][label] += value
            elif part == "sum_us":
                self.sums_us[metric][label] += value
            elif part.startswith("b"):
                counts = self.histograms[metric].setdefault(label, [0] * (len(BOUNDS) + 1))
                counts[int(part[1:])] += value

    def total(self, metric: str, family: str | None = None) -> int:
        counts = self.counters[metric].items()
        return sum(v for (fam, _f), v in counts if family is None or fam == family)

    def busy(self, family: str | None = None) -> int:
        """How often a resource was found busy: acquires that waited in vain, and jobs that
        were parked behind it (admission; their own acquire then finds it free, as a rule).
        Never more than the acquires: a job parked and then found busy once more is one run
        that found it busy, not two (a "busy 200 %" row)."""
        found = self.total("contended", family) + self.total("parked", family)
        return min(found, self.total("acquire_attempts", family))

    def merged_histogram(self, metric: str, family: str | None = None) -> list[int]:
        merged = [0] * (len(BOUNDS) + 1)
        for (fam, _func), counts in self.histograms[metric].items():
            if family is None or fam == family:
                merged = [a + b for a, b in zip(merged, counts, strict=True)]
        return merged

    def families(self) -> set[str]:
        labelled: list[dict[Labels, Any]] = [*self.counters.values(), *self.histograms.values()]
        return {fam for per in labelled for fam, _ in per}


def percentile(counts: list[int], q: float) -> float | None:
    """Upper bound (seconds) of the bucket holding the ``q`` quantile (0..1), None if empty:
    accurate to one bucket by construction; the +Inf bucket reports the last finite bound."""
    total = sum(counts)
    if not total:
        return None
    running = 0
    for index, n in enumerate(counts):
        running += n
        if running >= q * total and n:
            return BOUNDS[min(index, len(BOUNDS) - 1)]
    return BOUNDS[-1]


def _buckets(minutes: int, now: float | None) -> list[tuple[int, dict[Any, Any]]]:
    """``[(minute_start, raw bucket)]`` of the last ``minutes`` minutes, newest first."""
    now = time.time() if now is None else now
    starts = [_minute(now - back * BUCKET_SECONDS) for back in range(minutes)]
    prefix = conf.get().KEY_PREFIX
    pipe = client().pipeline(transaction=False)
    for start in starts:
        pipe.hgetall(bucket_key(prefix, start))
    return list(zip(starts, pipe.execute(), strict=True))


def window(seconds: float, now: float | None = None) -> Series:
    """Metrics summed over the last ``seconds`` (whole minutes, current one included)."""
    buckets = _buckets(max(1, int(seconds // BUCKET_SECONDS) + 1), now)
    return Series(*(raw for _start, raw in buckets))


def per_minute(metric: str, minutes: int, now: float | None = None) -> list[tuple[int, int]]:
    """``[(minute_start, total)]`` of one counter, oldest first (for charts)."""
    return [(start, Series(raw).total(metric)) for start, raw in reversed(_buckets(minutes, now))]


def totals() -> Series:
    """All-time totals (Prometheus counters)."""
    return Series(client().hgetall(totals_key(conf.get().KEY_PREFIX)))


def record_active_sample(total: int, now: float | None = None) -> None:
    """Remember the active-lock count at ``now`` (for the 'growing without falling' alert)."""
    now = time.time() if now is None else now
    key = samples_key(conf.get().KEY_PREFIX)
    keep = max(conf.get().ALERTS["ACTIVE_GROWTH"] * 2, 3600)
    pipe = client().pipeline(transaction=False)
    pipe.zadd(key, {f"{now:.3f}:{total}": now})
    pipe.zremrangebyscore(key, "-inf", now - keep)
    pipe.expire(key, int(keep))
    pipe.execute()


def active_samples(since: float) -> list[tuple[float, int]]:
    """``[(unix time, active locks)]`` recorded since ``since``, oldest first."""
    raw = client().zrangebyscore(samples_key(conf.get().KEY_PREFIX), since, "+inf")
    members = (text(member).partition(":") for member in raw)
    return [(float(at), int(total)) for at, _, total in members]

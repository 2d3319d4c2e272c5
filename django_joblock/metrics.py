"""Counters and histograms stored in Redis, per family and job function (never per resource).

This module owns the metric structures: :data:`METRICS` is the one table of metrics (name,
kind, help), read by the recorder here and by the Prometheus exporter; the field format below
is written and parsed only here.

Events are first added to a per-process buffer (a dict increment: no I/O on the hot path) and
flushed to Redis by one Lua call that adds them to two hashes:

- ``P:{metrics}:b:<minute>``: the 60-second bucket the flush falls in, expiring after
  ``METRICS_RETENTION`` seconds: rates, ratios and percentiles over recent windows
  (:func:`window`, :func:`per_minute`);
- ``P:{metrics}:total``: all-time totals, for Prometheus counters (:func:`totals`).

Both keys share the ``{metrics}`` hash tag, so the flush is one Redis-Cluster-safe script.

When is the buffer flushed? Inside an RQ job, together with the lock release (one round trip,
the release's own), and at the end of every job run that still has something buffered (a job
without a lock, a replay, contention, a requeue, a give-up, a loss: :func:`flush_pending`), so
a short-lived work horse that ``os._exit``\\ s loses nothing. Outside jobs, at most every
``FLUSH_INTERVAL`` seconds with a release, by the renewal thread's periodic wake-up, and at
interpreter exit.

Field names: ``<metric>|<family>|<function>`` for counters, ``<metric>:b<i>|...`` for the count
of observations in histogram bucket ``i`` (upper bounds :data:`BOUNDS`, in seconds) and
``<metric>:sum_us|...`` for their sum in microseconds.
"""

from __future__ import annotations

import atexit
import bisect
import enum
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from . import conf, lua
from .backend import REDIS_ERRORS, connection, text
from .keys import active_samples_key, metric_bucket_key, metric_totals_key


class Kind(enum.StrEnum):
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Metric:
    """One metric: its name in Redis and in code, its kind and its help text. Prometheus
    exports it as ``joblock_<exported or name>``, counters with ``_total``."""

    name: str
    kind: Kind
    help: str
    exported: str = ""


COUNTER, HISTOGRAM = Kind.COUNTER, Kind.HISTOGRAM

# The one table: adding a metric is one line here (then record it with count()/observe()).
METRICS = (
    Metric("acquire_attempts", COUNTER, "Lock acquire calls."),
    Metric("acquired", COUNTER, "Acquire calls that got the lock."),
    Metric("contended", COUNTER, "Acquire calls that found the lock busy for the whole wait."),
    Metric("acquire_errors", COUNTER, "Acquire calls that failed because Redis was unavailable."),
    Metric("renewed", COUNTER, "Successful heartbeat renewals."),
    Metric("renew_failed", COUNTER, "Failed heartbeat renewals (timeouts, dropped connections)."),
    Metric(
        "lost",
        COUNTER,
        "Locks lost while held (expired, taken over, renewals failed, max_hold).",
        exported="locks_lost",
    ),
    Metric("requeued", COUNTER, "Jobs requeued because their lock was busy."),
    Metric("given_up", COUNTER, "Jobs failed with LockContentionTimeout after REQUEUE_MAX_WAIT."),
    Metric("skipped", COUNTER, "Jobs skipped (on_conflict='skip') because their lock was busy."),
    Metric("duplicates_blocked", COUNTER, "Duplicate runs blocked by an idempotency record."),
    Metric(
        "duplicates_in_flight",
        COUNTER,
        "Contended runs whose lock's holder runs the same idempotency key (a second delivery).",
    ),
    Metric(
        "blocked_at_enqueue",
        COUNTER,
        "Duplicate .delay() calls of a unique job that returned the live job.",
    ),
    Metric("stale_fence_rejections", COUNTER, "Writes refused by fenced_update (StaleFence)."),
    Metric(
        "near_timeout",
        COUNTER,
        "Job runs that took at least ALERTS['TIMEOUT_RATIO'] of their RQ job_timeout.",
    ),
    Metric(
        "failed_runs",
        COUNTER,
        "Job runs that raised (failed, lost their lock, gave up): RQ fails or retries them.",
    ),
    Metric(
        "rq_retries",
        COUNTER,
        "Failed job runs that RQ retries (their Retry had retries left).",
    ),
    Metric("forced_releases", COUNTER, "Locks released by an operator (admin or joblock_release)."),
    Metric("wait_seconds", HISTOGRAM, "Time spent waiting for a lock, until acquired or given up."),
    Metric("hold_seconds", HISTOGRAM, "Time a lock was held, acquire to release."),
    Metric(
        "start_wait_seconds",
        HISTOGRAM,
        "Time from a job's enqueue to the start of the run that took its lock.",
    ),
)
COUNTERS = frozenset(m.name for m in METRICS if m.kind is COUNTER)
HISTOGRAMS = frozenset(m.name for m in METRICS if m.kind is HISTOGRAM)

# Histogram bucket upper bounds in seconds (the last bucket is +Inf).
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
    """Index of the histogram bucket ``seconds`` falls in."""
    return bisect.bisect_left(BOUNDS, seconds)


def _minute(now: float) -> int:
    return int(now // BUCKET_SECONDS) * BUCKET_SECONDS


def _unknown(metric: str, kind: Kind) -> ValueError:
    return ValueError(f"{metric!r} is not a {kind.value} in django_joblock.metrics.METRICS")


# -- recording ------------------------------------------------------------------------------
class Recorder:
    """This process's buffer of metric increments."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._pending: dict[str, int] = defaultdict(int)
        self._last_flush = time.monotonic()

    def count(self, metric: str, family: str, func: str = "", n: int = 1) -> None:
        if metric not in COUNTERS:
            raise _unknown(metric, COUNTER)
        with self._lock:
            self._pending[f"{metric}|{family}|{func}"] += n

    def observe(self, metric: str, family: str, func: str, seconds: float) -> None:
        if metric not in HISTOGRAMS:
            raise _unknown(metric, HISTOGRAM)
        labels = f"|{family}|{func}"
        with self._lock:
            self._pending[f"{metric}:b{bucket_of(seconds)}{labels}"] += 1
            self._pending[f"{metric}:sum_us{labels}"] += int(seconds * 1_000_000)

    def acquire(self, family: str, func: str, waited: float, *, acquired: bool) -> None:
        """One ``acquire()`` call's counters and wait time, in one buffer update (hot path)."""
        labels = f"|{family}|{func}"
        with self._lock:
            pending = self._pending
            pending["acquire_attempts" + labels] += 1
            pending[("acquired" if acquired else "contended") + labels] += 1
            pending[f"wait_seconds:b{bisect.bisect_left(BOUNDS, waited)}{labels}"] += 1
            pending["wait_seconds:sum_us" + labels] += int(waited * 1_000_000)

    def pending(self) -> bool:
        return bool(self._pending)

    def due(self) -> bool:
        """True when a flush is due by time (and there is something to flush)."""
        return bool(self._pending) and time.monotonic() - self._last_flush >= FLUSH_INTERVAL

    def take(self) -> dict[str, int]:
        """Remove and return the pending increments."""
        with self._lock:
            pending, self._pending = self._pending, defaultdict(int)
            self._last_flush = time.monotonic()
        return dict(pending)

    def restore(self, pending: dict[str, int]) -> None:
        """Put back increments whose flush failed (they go out with the next one)."""
        with self._lock:
            for name, n in pending.items():
                self._pending[name] += n

    def command(self, pending: dict[str, int], at: float | None = None) -> list[Any]:
        """The ``EVALSHA`` arguments that add ``pending`` to Redis, in the bucket of the minute
        of ``at`` (Unix seconds; default now)."""
        settings = conf.get()
        args: list[Any] = [
            "EVALSHA",
            lua.METRICS_SHA,
            2,
            metric_bucket_key(settings.KEY_PREFIX, _minute(time.time() if at is None else at)),
            metric_totals_key(settings.KEY_PREFIX),
            int(settings.METRICS_RETENTION),
        ]
        for name, n in pending.items():
            args += [name, n]
        return args

    def flush(self, client: Any | None = None, at: float | None = None) -> bool:
        """Write the buffer now (one round trip), into the bucket of ``at`` (default now).
        False, keeping the buffer, if Redis failed."""
        pending = self.take()
        if not pending:
            return True
        try:
            lua.run_args(client or connection(conf.get().REDIS_ALIAS), self.command(pending, at=at))
        except REDIS_ERRORS:
            self.restore(pending)
            return False
        return True


_recorder: Recorder | None = None
_recorder_lock = threading.Lock()


def recorder() -> Recorder:
    """This process's :class:`Recorder` (a fresh one after ``fork``: the parent's buffer is
    the parent's to flush)."""
    global _recorder
    current = _recorder
    if current is not None:
        return current
    with _recorder_lock:
        if _recorder is None:
            _recorder = Recorder()
        return _recorder


def _after_fork_in_child() -> None:
    global _recorder, _recorder_lock
    _recorder = None
    _recorder_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def enabled() -> bool:
    return bool(conf.get().METRICS)


def count(metric: str, family: str, func: str = "", n: int = 1) -> None:
    """Add ``n`` to counter ``metric`` of ``family`` / ``func`` (buffered)."""
    if enabled():
        recorder().count(metric, family, func, n)


def observe(metric: str, family: str, func: str, seconds: float) -> None:
    """Record one observation of histogram ``metric`` (buffered)."""
    if enabled():
        recorder().observe(metric, family, func, seconds)


def record_acquire(family: str, func: str, waited: float, *, acquired: bool) -> None:
    """One ``acquire()`` call's counters and wait time (buffered; the lock's hot path)."""
    if enabled():
        recorder().acquire(family, func, waited, acquired=acquired)


def take_for_flush(*, force: bool) -> dict[str, int]:
    """The pending increments to send along with another command now (empty if not due)."""
    if not enabled():
        return {}
    current = recorder()
    if force or current.due():
        return current.take()
    return {}


def flush_now(at: float | None = None) -> None:
    """Flush the buffer in this thread (used where the process may end next), into the
    bucket of the minute of ``at`` (Unix seconds, default now: a test of an alert that compares
    with the past files real counts there)."""
    if enabled():
        recorder().flush(at=at)


def flush_pending() -> None:
    """Flush whatever is buffered, if anything (one round trip then, none otherwise): the end
    of every job run, whose work horse may ``os._exit`` right after."""
    current = _recorder
    if current is not None and current.pending() and enabled():
        current.flush()


@atexit.register
def _flush_at_exit() -> None:
    current = _recorder
    if current is not None and current.pid == os.getpid():
        try:
            current.flush()
        except Exception:  # noqa: BLE001 - interpreter shutdown: settings or Redis may be gone
            pass


# -- reading ---------------------------------------------------------------------------------
def _client() -> Any:
    return connection(conf.get().REDIS_ALIAS)


Labels = tuple[str, str]  # (family, function)


@dataclass
class Series:
    """Metric values summed over a window: ``counters[metric][(family, func)]`` and
    ``histograms[metric][(family, func)]`` = per-bucket counts (plus ``sums_us``)."""

    counters: dict[str, dict[Labels, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )
    histograms: dict[str, dict[Labels, list[int]]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    sums_us: dict[str, dict[Labels, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )

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
        return sum(
            v for (fam, _f), v in self.counters[metric].items() if family is None or fam == family
        )

    def merged_histogram(self, metric: str, family: str | None = None) -> list[int]:
        merged = [0] * (len(BOUNDS) + 1)
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
    for index, n in enumerate(counts):
        running += n
        if running >= rank and n:
            return BOUNDS[min(index, len(BOUNDS) - 1)]
    return BOUNDS[-1]


def _buckets(starts: list[int]) -> list[dict[Any, Any]]:
    prefix = conf.get().KEY_PREFIX
    pipe = _client().pipeline(transaction=False)
    for start in starts:
        pipe.hgetall(metric_bucket_key(prefix, start))
    return list(pipe.execute())


def window(seconds: float, now: float | None = None) -> Series:
    """Metrics summed over the last ``seconds`` (whole minutes, current one included)."""
    now = time.time() if now is None else now
    minutes = max(1, int(seconds // BUCKET_SECONDS) + 1)
    series = Series()
    for raw in _buckets([_minute(now - back * BUCKET_SECONDS) for back in range(minutes)]):
        series.add(raw)
    return series


def per_minute(metric: str, minutes: int, now: float | None = None) -> list[tuple[int, int]]:
    """``[(minute_start, total)]`` of one counter, oldest first (for charts)."""
    now = time.time() if now is None else now
    starts = [_minute(now - back * BUCKET_SECONDS) for back in range(minutes)]
    out = []
    for start, raw in zip(starts, _buckets(starts), strict=True):
        series = Series()
        series.add(raw)
        out.append((start, series.total(metric)))
    return list(reversed(out))


def totals() -> Series:
    """All-time totals (Prometheus counters)."""
    series = Series()
    series.add(_client().hgetall(metric_totals_key(conf.get().KEY_PREFIX)))
    return series


def record_active_sample(total: int, now: float | None = None) -> None:
    """Remember the active-lock count at ``now`` (for the 'growing without falling' alert)."""
    now = time.time() if now is None else now
    key = active_samples_key(conf.get().KEY_PREFIX)
    keep = max(conf.get().ALERTS["ACTIVE_GROWTH"] * 2, 3600)
    pipe = _client().pipeline(transaction=False)
    pipe.zadd(key, {f"{now:.3f}:{total}": now})
    pipe.zremrangebyscore(key, "-inf", now - keep)
    pipe.expire(key, int(keep))
    pipe.execute()


def active_samples(since: float) -> list[tuple[float, int]]:
    """``[(unix time, active locks)]`` recorded since ``since``, oldest first."""
    raw = _client().zrangebyscore(active_samples_key(conf.get().KEY_PREFIX), since, "+inf")
    out = []
    for member in raw:
        at, _, total = text(member).partition(":")
        out.append((float(at), int(total)))
    return out

"""Counters and histograms stored in Redis, per family and job function (never per resource).

Events are first added to a per-process buffer (a dict increment: no I/O on the hot path) and
flushed to Redis by one Lua call that adds them to two hashes:

- ``P:{metrics}:b:<minute>``: the 60-second bucket the flush falls in, expiring after
  ``METRICS_RETENTION`` seconds: rates, ratios and percentiles over recent windows;
- ``P:{metrics}:total``: all-time totals, for Prometheus counters.

Both keys share the ``{metrics}`` hash tag, so the flush is one Redis-Cluster-safe script.

When is the buffer flushed? Inside an RQ job, together with the lock release (one round trip,
the release's own), and right away on the events after which a work horse may end without a
release (contention, requeue, give-up, loss): a short-lived horse that ``os._exit``s loses
nothing. Outside jobs, at most every ``FLUSH_INTERVAL`` seconds with a release, by the renewal
thread's periodic wake-up, and at interpreter exit.

Field names: ``<metric>|<family>|<function>`` for counters, ``<metric>:b<i>|...`` for the count
of observations in histogram bucket ``i`` (upper bounds :data:`BOUNDS`, in seconds) and
``<metric>:sum_us|...`` for their sum in microseconds.
"""

from __future__ import annotations

import atexit
import bisect
import os
import threading
import time
from collections import defaultdict
from typing import Any

from . import conf, lua
from .backend import REDIS_ERRORS, connection

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

COUNTERS = (
    "acquire_attempts",
    "acquired",
    "contended",
    "acquire_errors",
    "renewed",
    "renew_failed",
    "lost",
    "requeued",
    "given_up",
    "duplicates_blocked",
    "stale_fence_rejections",
    "forced_releases",
    "skipped",
    "blocked_at_enqueue",
)
HISTOGRAMS = ("wait_seconds", "hold_seconds", "start_wait_seconds")


def bucket_of(seconds: float) -> int:
    """Index of the histogram bucket ``seconds`` falls in."""
    return bisect.bisect_left(BOUNDS, seconds)


def keys(prefix: str, now: float | None = None) -> tuple[str, str]:
    """(current bucket key, totals key)."""
    minute = int((time.time() if now is None else now) // BUCKET_SECONDS) * BUCKET_SECONDS
    return f"{prefix}:{{metrics}}:b:{minute}", f"{prefix}:{{metrics}}:total"


class Recorder:
    """This process's buffer of metric increments."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._pending: dict[str, int] = defaultdict(int)
        self._last_flush = time.monotonic()

    def count(self, metric: str, family: str, func: str = "", n: int = 1) -> None:
        with self._lock:
            self._pending[f"{metric}|{family}|{func}"] += n

    def observe(self, metric: str, family: str, func: str, seconds: float) -> None:
        field = f"|{family}|{func}"
        with self._lock:
            self._pending[f"{metric}:b{bucket_of(seconds)}{field}"] += 1
            self._pending[f"{metric}:sum_us{field}"] += int(seconds * 1_000_000)

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
            for field, n in pending.items():
                self._pending[field] += n

    def command(self, pending: dict[str, int]) -> list[Any]:
        """The ``EVALSHA`` arguments that add ``pending`` to Redis."""
        bucket, total = keys(conf.get().KEY_PREFIX)
        args: list[Any] = [
            "EVALSHA",
            lua.METRICS_SHA,
            2,
            bucket,
            total,
            int(conf.get().METRICS_RETENTION),
        ]
        for field, n in pending.items():
            args += [field, n]
        return args

    def flush(self, client: Any | None = None) -> bool:
        """Write the buffer now (one round trip). False, keeping the buffer, if Redis failed."""
        pending = self.take()
        if not pending:
            return True
        try:
            lua.run_args(client or connection(conf.get().REDIS_ALIAS), self.command(pending))
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
    """One ``acquire()`` call's counters and wait time, in one buffer update (hot path)."""
    if not conf.get().METRICS:
        return
    labels = f"|{family}|{func}"
    current = recorder()
    with current._lock:
        pending = current._pending
        pending["acquire_attempts" + labels] += 1
        pending[("acquired" if acquired else "contended") + labels] += 1
        pending[f"wait_seconds:b{bisect.bisect_left(BOUNDS, waited)}{labels}"] += 1
        pending["wait_seconds:sum_us" + labels] += int(waited * 1_000_000)


def take_for_flush(*, force: bool) -> dict[str, int]:
    """The pending increments to send along with another command now (empty if not due)."""
    if not enabled():
        return {}
    current = recorder()
    if force or current.due():
        return current.take()
    return {}


def flush_now() -> None:
    """Flush the buffer in this thread (used where the process may end next)."""
    if enabled():
        recorder().flush()


@atexit.register
def _flush_at_exit() -> None:
    current = _recorder
    if current is not None and current.pid == os.getpid():
        try:
            current.flush()
        except Exception:  # noqa: BLE001 - interpreter shutdown: settings or Redis may be gone
            pass

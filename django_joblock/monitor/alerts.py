"""Alerts from the ``JOBLOCK["ALERTS"]`` thresholds, over the last ``WINDOW`` seconds:

- ``contention``: a family's busy acquires / acquire attempts is at least ``CONTENTION_RATIO``;
- ``contention_spike``: a family's contention is ``CONTENTION_SPIKE`` times its own over the
  ``BASELINE`` seconds before (and at least ``MIN_SPIKE``);
- ``renew_failures``, ``acquire_errors`` (Redis unavailable), ``locks_lost``, ``given_up`` (on
  a busy lock), ``near_timeout`` (runs that took ``TIMEOUT_RATIO`` or more of their RQ
  ``job_timeout``): at least as many as the threshold of the same name in capitals;
- ``long_wait``: a family's p99 wait from enqueue to start is ``LONG_WAIT`` seconds or more
  (to one histogram bucket);
- ``long_hold``: a lock held ``HOLD_FACTOR`` times its family's usual (p95) hold time, and
  longer than ``MIN_HOLD`` seconds;
- ``active_growth``: active locks grew without ever falling for ``ACTIVE_GROWTH`` seconds;
- ``no_scheduler``: a queue whose jobs requeue with delays has no RQ scheduler.

A ratio needs ``MIN_ATTEMPTS`` attempts (in each period, for a spike).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from typing import Any

from .. import conf, metrics
from ..locks import index
from . import active

MIN_ATTEMPTS = 20  # below this, a ratio is noise
MIN_SPIKE = 0.1  # a contention ratio below this is never a spike, whatever the baseline
MIN_HOLD = 5.0  # seconds; a lock held less than this never counts as "far too long"
MIN_HOLD_SAMPLES = 20
# Index entries per family the long-hold alert reads: all of them (a hung holder renews its
# lock, so it is never among the soonest to expire), up to this bound.
LONG_HOLD_SCAN = 100_000

# Alerts on a counter reaching the threshold ``alert.upper()``: (alert, metric, what the count
# counts, whether the message lists the count of each family).
_COUNTED = (
    ("renew_failures", "renew_failed", "lock renewals failed", False),
    ("acquire_errors", "acquire_errors", "acquire(s) failed: Redis unavailable", True),
    ("locks_lost", "lost", "lock(s) lost by their holders", True),
    ("given_up", "given_up", "job(s) gave up on a busy lock", True),
    ("near_timeout", "near_timeout", "job run(s) neared their job_timeout", True),
)


@dataclass
class Alert:
    name: str
    family: str
    message: str
    value: float
    threshold: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def evaluate(now: float | None = None) -> list[Alert]:
    """Every alert firing now. Records an active-lock sample as a side effect (the history the
    growth alert needs is built by whoever evaluates: the command, the dashboard, the
    Prometheus scrape)."""
    now = time.time() if now is None else now
    limits = conf.get().ALERTS
    window = limits["WINDOW"]
    recent = metrics.window(window, now=now)
    last = f"in the last {window:g}s"
    families = sorted(recent.families())
    fired: list[Alert] = []
    for family in families:
        attempts = recent.total("acquire_attempts", family)
        busy = recent.total("contended", family)
        if attempts >= MIN_ATTEMPTS and busy / attempts >= limits["CONTENTION_RATIO"]:
            message = f"{busy} of {attempts} acquires of {family!r} found the lock busy {last}"
            ratio = limits["CONTENTION_RATIO"]
            fired.append(Alert("contention", family, message, busy / attempts, ratio))
    fired += _spikes(recent, limits, now)
    for name, metric, what, per_family in _COUNTED:
        count, limit = recent.total(metric), limits[name.upper()]
        if count >= limit:
            message = f"{count} {what} {last}"
            if per_family:
                counts = ((family, recent.total(metric, family)) for family in families)
                message += f" ({', '.join(f'{family} {n}' for family, n in counts if n)})"
            fired.append(Alert(name, "", message, count, limit))
    for family in families:
        p99 = metrics.percentile(recent.merged_histogram("start_wait_seconds", family), 0.99)
        if p99 is not None and p99 >= limits["LONG_WAIT"]:
            message = f"jobs of {family!r} waited up to {p99:g}s (p99) from enqueue to start {last}"
            fired.append(Alert("long_wait", family, message, p99, limits["LONG_WAIT"]))
    fired += _long_holds(limits["HOLD_FACTOR"])
    fired += _growth(limits["ACTIVE_GROWTH"], now)
    for queue in active.queues_without_scheduler():
        message = f"no RQ scheduler for queue {queue!r}, whose jobs requeue on contention"
        fired.append(Alert("no_scheduler", "", message, 1, 0))
    return fired


def _spikes(recent: metrics.Series, limits: dict[str, float], now: float) -> list[Alert]:
    """Families whose contention is far above their own over the BASELINE before: a static
    ratio cannot tell a family that is always busy from one that just became so."""
    window, baseline_period = limits["WINDOW"], limits["BASELINE"]
    if baseline_period <= window:
        return []
    # The minutes before the window's oldest bucket: read once, none of them twice.
    earlier = metrics.window(baseline_period, now=now - window - metrics.BUCKET_SECONDS)
    fired = []
    for family in sorted(recent.families()):
        attempts = recent.total("acquire_attempts", family)
        before = earlier.total("acquire_attempts", family)
        if attempts < MIN_ATTEMPTS or before < MIN_ATTEMPTS:
            continue
        ratio = recent.total("contended", family) / attempts
        baseline = earlier.total("contended", family) / before
        if ratio >= MIN_SPIKE and ratio >= limits["CONTENTION_SPIKE"] * baseline:
            message = (
                f"{ratio:.0%} of the acquires of {family!r} found the lock busy in the last "
                f"{window:g}s, against {baseline:.0%} over the {baseline_period:g}s before"
            )
            threshold = limits["CONTENTION_SPIKE"] * baseline
            fired.append(Alert("contention_spike", family, message, ratio, threshold))
    return fired


def _long_holds(factor: float) -> list[Alert]:
    """One alert per family with locks held far past its usual (p95) hold time."""
    totals = metrics.totals()
    usual: dict[str, float | None] = {}
    worst: dict[str, list[Any]] = {}
    for held in active.active_locks(limit=LONG_HOLD_SCAN):
        if held.family not in usual:
            counts = totals.merged_histogram("hold_seconds", held.family)
            enough = sum(counts) >= MIN_HOLD_SAMPLES
            usual[held.family] = metrics.percentile(counts, 0.95) if enough else None
        p95 = usual[held.family]
        if p95 is not None and held.held_for > max(MIN_HOLD, factor * p95):
            worst.setdefault(held.family, []).append(held)
    fired = []
    for family, held_long in sorted(worst.items()):
        longest = max(held_long, key=lambda lock: lock.held_for)
        p95 = usual[family] or 0.0
        message = (
            f"{len(held_long)} lock(s) held far longer than usual; longest {longest.resource} "
            f"for {longest.held_for:.0f}s by {longest.host}:{longest.pid} (job "
            f"{longest.job_id or '-'}); the family's p95 hold is {p95:g}s"
        )
        fired.append(Alert("long_hold", family, message, longest.held_for, factor * p95))
    return fired


def _growth(period: float, now: float) -> list[Alert]:
    metrics.record_active_sample(sum(index.active_counts().values()), now=now)
    samples = metrics.active_samples(now - period)
    if len(samples) < 3 or samples[-1][0] - samples[0][0] < period * 0.9:
        return []
    counts = [count for _at, count in samples]
    if counts[-1] <= counts[0] or any(b < a for a, b in itertools.pairwise(counts)):
        return []
    message = f"active locks grew from {counts[0]} to {counts[-1]} over {period:g}s without falling"
    return [Alert("active_growth", "", message, counts[-1], counts[0])]

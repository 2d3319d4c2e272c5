"""Alerts from ``JOBLOCK["ALERTS"]`` thresholds, computed from :mod:`monitoring` reads.

===================  ==========================================================================
``contention``       a family's busy acquires / acquire attempts over ``WINDOW`` seconds is at
                     least ``CONTENTION_RATIO`` (with at least ``MIN_ATTEMPTS`` attempts)
``contention_spike`` a family's contention over ``WINDOW`` is ``CONTENTION_SPIKE`` times its
                     contention over the ``BASELINE`` seconds before it (and at least
                     ``MIN_SPIKE``; ``MIN_ATTEMPTS`` attempts in each period)
``renew_failures``   at least ``RENEW_FAILURES`` failed renewals in ``WINDOW`` seconds
``acquire_errors``   at least ``ACQUIRE_ERRORS`` acquires failed on an unavailable Redis in
                     ``WINDOW`` seconds (the count of each family in the message)
``locks_lost``       at least ``LOCKS_LOST`` locks lost by their holders in ``WINDOW`` seconds
``given_up``         at least ``GIVEN_UP`` jobs gave up on a busy lock in ``WINDOW`` seconds
``near_timeout``     at least ``NEAR_TIMEOUT`` job runs in ``WINDOW`` seconds took ``TIMEOUT_RATIO``
                     or more of their RQ ``job_timeout``
``long_wait``        a family's p99 wait from enqueue to start over ``WINDOW`` is ``LONG_WAIT``
                     seconds or more (to one histogram bucket)
``long_hold``        a lock held ``HOLD_FACTOR`` times longer than its family's usual (p95) hold
                     time, and longer than ``MIN_HOLD`` seconds
``active_growth``    active locks grew without ever falling for ``ACTIVE_GROWTH`` seconds
``no_scheduler``     a queue whose jobs requeue with delays has no RQ scheduler
===================  ==========================================================================
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


# Alerts that fire when a counter reaches its threshold over WINDOW: (alert, metric, the
# ALERTS key of the threshold, what the count counts).
_COUNTED = (
    ("acquire_errors", "acquire_errors", "ACQUIRE_ERRORS", "acquire(s) failed: Redis unavailable"),
    ("locks_lost", "lost", "LOCKS_LOST", "lock(s) lost by their holders"),
    ("given_up", "given_up", "GIVEN_UP", "job(s) gave up on a busy lock"),
    ("near_timeout", "near_timeout", "NEAR_TIMEOUT", "job run(s) neared their job_timeout"),
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
    recent = metrics.window(limits["WINDOW"], now=now)
    fired: list[Alert] = []
    for family in sorted(recent.families()):
        attempts = recent.total("acquire_attempts", family)
        busy = recent.total("contended", family)
        if attempts >= MIN_ATTEMPTS and busy / attempts >= limits["CONTENTION_RATIO"]:
            fired.append(
                Alert(
                    "contention",
                    family,
                    f"{busy} of {attempts} acquires of {family!r} found the lock "
                    f"busy in the last {limits['WINDOW']:g}s",
                    busy / attempts,
                    limits["CONTENTION_RATIO"],
                )
            )
    fired += _spikes(recent, limits, now)
    failed = recent.total("renew_failed")
    if failed >= limits["RENEW_FAILURES"]:
        fired.append(
            Alert(
                "renew_failures",
                "",
                f"{failed} lock renewals failed in the last {limits['WINDOW']:g}s",
                failed,
                limits["RENEW_FAILURES"],
            )
        )
    for name, metric, limit, what in _COUNTED:
        count = recent.total(metric)
        if count >= limits[limit]:
            by_family = ", ".join(
                f"{family} {n}"
                for family in sorted(recent.families())
                if (n := recent.total(metric, family))
            )
            fired.append(
                Alert(
                    name,
                    "",
                    f"{count} {what} in the last {limits['WINDOW']:g}s ({by_family})",
                    count,
                    limits[limit],
                )
            )
    for family in sorted(recent.families()):
        p99 = metrics.percentile(recent.merged_histogram("start_wait_seconds", family), 0.99)
        if p99 is not None and p99 >= limits["LONG_WAIT"]:
            fired.append(
                Alert(
                    "long_wait",
                    family,
                    f"jobs of {family!r} waited up to {p99:g}s (p99) from enqueue to start "
                    f"in the last {limits['WINDOW']:g}s",
                    p99,
                    limits["LONG_WAIT"],
                )
            )
    fired += _long_holds(limits["HOLD_FACTOR"])
    fired += _growth(limits["ACTIVE_GROWTH"], now)
    for queue in active.queues_without_scheduler():
        fired.append(
            Alert(
                "no_scheduler",
                "",
                f"no RQ scheduler for queue {queue!r}, whose jobs requeue on contention",
                1,
                0,
            )
        )
    return fired


def _spikes(recent: metrics.Series, limits: dict[str, float], now: float) -> list[Alert]:
    """Families whose contention over WINDOW is far above their own over the BASELINE before:
    a static ratio cannot tell a family that is always busy from one that just became so."""
    window = limits["WINDOW"]
    if limits["BASELINE"] <= window:
        return []
    # The minutes before the window's oldest bucket: read once, none of them twice.
    earlier = metrics.window(limits["BASELINE"], now=now - window - metrics.BUCKET_SECONDS)
    fired = []
    for family in sorted(recent.families()):
        attempts = recent.total("acquire_attempts", family)
        before = earlier.total("acquire_attempts", family)
        if attempts < MIN_ATTEMPTS or before < MIN_ATTEMPTS:
            continue
        ratio = recent.total("contended", family) / attempts
        baseline = earlier.total("contended", family) / before
        if ratio >= MIN_SPIKE and ratio >= limits["CONTENTION_SPIKE"] * baseline:
            fired.append(
                Alert(
                    "contention_spike",
                    family,
                    f"{ratio:.0%} of the acquires of {family!r} found the lock busy in the last "
                    f"{window:g}s, against {baseline:.0%} over the {limits['BASELINE']:g}s "
                    "before",
                    ratio,
                    limits["CONTENTION_SPIKE"] * baseline,
                )
            )
    return fired


def _long_holds(factor: float) -> list[Alert]:
    """One alert per family with locks held far past its usual (p95) hold time.

    Reads every active lock (up to ``LONG_HOLD_SCAN`` per family, in one pipelined round
    trip): a sample of the soonest to expire would miss exactly the hung holder that keeps
    renewing its lock.
    """
    history = metrics.totals()
    usual: dict[str, float | None] = {}
    worst: dict[str, list[Any]] = {}
    for held in active.active_locks(limit=LONG_HOLD_SCAN):
        if held.family not in usual:
            counts = history.merged_histogram("hold_seconds", held.family)
            enough = sum(counts) >= MIN_HOLD_SAMPLES
            usual[held.family] = metrics.percentile(counts, 0.95) if enough else None
        p95 = usual[held.family]
        if p95 is not None and held.held_for > max(MIN_HOLD, factor * p95):
            worst.setdefault(held.family, []).append(held)
    fired = []
    for fam, held_long in sorted(worst.items()):
        longest = max(held_long, key=lambda lock: lock.held_for)
        p95 = usual[fam] or 0.0
        fired.append(
            Alert(
                "long_hold",
                fam,
                f"{len(held_long)} lock(s) held far longer than usual; longest {longest.resource} "
                f"for {longest.held_for:.0f}s by {longest.host}:{longest.pid} (job "
                f"{longest.job_id or '-'}); the family's p95 hold is {p95:g}s",
                longest.held_for,
                factor * p95,
            )
        )
    return fired


def _growth(period: float, now: float) -> list[Alert]:
    total = sum(index.active_counts().values())
    metrics.record_active_sample(total, now=now)
    samples = metrics.active_samples(now - period)
    if len(samples) < 3 or samples[-1][0] - samples[0][0] < period * 0.9:
        return []
    counts = [count for _at, count in samples]
    if all(b >= a for a, b in itertools.pairwise(counts)) and counts[-1] > counts[0]:
        return [
            Alert(
                "active_growth",
                "",
                f"active locks grew from {counts[0]} to {counts[-1]} "
                f"over {period:g}s without falling",
                counts[-1],
                counts[0],
            )
        ]
    return []

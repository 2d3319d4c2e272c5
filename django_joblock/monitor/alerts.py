"""Alerts from the ``JOBLOCK["ALERTS"]`` thresholds over the last ``WINDOW`` seconds: contention
(absolute, and a spike against the family's own ``BASELINE``), counted events, long waits, long
holds, active-lock growth, queues without a scheduler, outbox messages that keep failing. A
ratio needs ``MIN_ATTEMPTS`` attempts; docs/observability.md ("Alerts") lists rules and defaults."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from .. import conf, metrics
from ..choices import OutboxStatus
from ..locks import index
from . import active

MIN_ATTEMPTS = 20  # below this, a ratio is noise
MIN_SPIKE = 0.1  # a contention ratio below this is never a spike, whatever the baseline
MIN_HOLD = 5.0  # seconds; a lock held less than this never counts as "far too long"
MIN_HOLD_SAMPLES = 20
# Index entries per family the long-hold alert reads: all of them (a hung holder renews its
# lock, so it is never among the soonest to expire), up to this bound.
LONG_HOLD_SCAN = 100_000
OUTBOX_ATTEMPTS = 5  # failed deliveries (about 30 s of retries) after which a message alerts

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


def evaluate(now: float | None = None, *, outbox_details: bool = True) -> list[Alert]:
    """Every alert firing now. Records an active-lock sample as a side effect: whoever evaluates
    (the command, the dashboard, a Prometheus scrape) builds the history growth needs.
    ``outbox_details=False`` leaves the oldest failing outbox message's key, handler and error
    out of ``outbox_failing`` (for viewers who may not see outbox messages: keys and provider
    errors carry business data)."""
    now = time.time() if now is None else now
    limits = conf.get().ALERTS
    window = limits["WINDOW"]
    period = limits["BASELINE"]
    recent = metrics.window(window, now=now)
    # A spike compares a family with its own contention in the minutes before the window (none
    # read twice): a static ratio cannot tell a family always busy from one just become so.
    earlier = metrics.Series()
    if period > window:
        earlier = metrics.window(period, now=now - window - metrics.BUCKET_SECONDS)
    last = f"in the last {window:g}s"
    families = sorted(recent.families())
    fired: list[Alert] = []
    spikes: list[Alert] = []
    waits: list[Alert] = []
    for family in families:
        attempts = recent.total("acquire_attempts", family)
        busy = recent.busy(family)
        before = earlier.total("acquire_attempts", family)
        ratio = busy / attempts if attempts >= MIN_ATTEMPTS else 0.0
        if ratio and ratio >= limits["CONTENTION_RATIO"]:
            message = f"{busy} of {attempts} acquires of {family!r} found the lock busy {last}"
            fired.append(Alert("contention", family, message, ratio, limits["CONTENTION_RATIO"]))
        if ratio and before >= MIN_ATTEMPTS:
            baseline = earlier.busy(family) / before
            threshold = limits["CONTENTION_SPIKE"] * baseline
            if ratio >= MIN_SPIKE and ratio >= threshold:
                message = (
                    f"{ratio:.0%} of the acquires of {family!r} found the lock busy {last}, "
                    f"against {baseline:.0%} over the {period:g}s before"
                )
                spikes.append(Alert("contention_spike", family, message, ratio, threshold))
        p99 = metrics.percentile(recent.merged_histogram("start_wait_seconds", family), 0.99)
        if p99 is not None and p99 >= limits["LONG_WAIT"]:
            message = f"jobs of {family!r} waited up to {p99:g}s (p99) from enqueue to start {last}"
            waits.append(Alert("long_wait", family, message, p99, limits["LONG_WAIT"]))
    fired += spikes
    for name, metric, what, per_family in _COUNTED:
        count = recent.total(metric)
        limit = limits[name.upper()]
        if count >= limit:
            by_family = ""
            if per_family:
                counts = ((family, recent.total(metric, family)) for family in families)
                by_family = f" ({', '.join(f'{family} {n}' for family, n in counts if n)})"
            message = f"{count} {what} {last}{by_family}"
            fired.append(Alert(name, "", message, count, limit))
    fired += waits + _long_holds(limits["HOLD_FACTOR"]) + _growth(limits["ACTIVE_GROWTH"], now)
    for name, queue in active.requeueing_queues().items():
        if not active.has_scheduler(queue):
            message = f"no RQ scheduler for queue {name!r}, whose jobs requeue on contention"
            fired.append(Alert("no_scheduler", "", message, 1, 0))
    fired += _outbox_failing(outbox_details)
    return fired


def _outbox_failing(details: bool) -> list[Alert]:
    """Outbox messages undelivered after :data:`OUTBOX_ATTEMPTS` failed deliveries, pending or
    dead-lettered (a handler that always fails): the status index answers it. With
    ``details``, the message names the oldest one, its handler and its last error."""
    from ..models import OutboxMessage

    failing = OutboxMessage.objects.filter(status__in=[OutboxStatus.PENDING, OutboxStatus.DEAD])
    failing = failing.filter(attempts__gte=OUTBOX_ATTEMPTS).order_by("created_at")
    if (first := failing.first()) is None:
        return []
    count = failing.count()
    dead = failing.filter(status=OutboxStatus.DEAD).count()
    message = (
        f"{count} outbox message(s) still undelivered after {OUTBOX_ATTEMPTS}+ attempts "
        f"({dead} dead-lettered: no more retries)"
    )
    if details:
        message = f"{message}; oldest {first.key} via {first.handler}: {first.last_error[:200]}"
    return [Alert("outbox_failing", "", message, count, OUTBOX_ATTEMPTS)]


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
            f"{len(held_long)} lock(s) held far longer than usual; longest {longest.label} "
            f"for {longest.held_for:.0f}s by {longest.host}:{longest.pid} "
            f"(job {longest.job_id or '-'}); the family's p95 hold is {p95:g}s"
        )
        fired.append(Alert("long_hold", family, message, longest.held_for, factor * p95))
    return fired


def _growth(period: float, now: float) -> list[Alert]:
    metrics.record_active_sample(sum(index.active_counts().values()), now=now)
    samples = metrics.active_samples(now - period)
    counts = [count for _at, count in samples]
    spanned = len(samples) >= 3 and samples[-1][0] - samples[0][0] >= period * 0.9
    if not spanned or counts[-1] <= counts[0] or any(b < a for a, b in itertools.pairwise(counts)):
        return []
    message = f"active locks grew from {counts[0]} to {counts[-1]} over {period:g}s without falling"
    return [Alert("active_growth", "", message, counts[-1], counts[0])]

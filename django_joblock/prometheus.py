"""Prometheus export (``pip install django-joblock[prometheus]``).

A custom collector that reads the all-time totals and the active-lock index from Redis at
scrape time, so every process's events (short-lived work horses included) are in one place
and no Prometheus client library state lives in the workers. Names follow Prometheus
conventions: ``joblock_*``, counters end in ``_total``, durations in ``_seconds``. Labels are
``family`` and ``function`` only: never a resource id, so cardinality stays bounded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from . import metrics, monitoring

COUNTER_HELP = {
    "acquire_attempts": "Lock acquire calls.",
    "acquired": "Acquire calls that got the lock.",
    "contended": "Acquire calls that found the lock busy for the whole wait.",
    "acquire_errors": "Acquire calls that failed because Redis was unavailable.",
    "renewed": "Successful heartbeat renewals.",
    "renew_failed": "Failed heartbeat renewals (timeouts, dropped connections).",
    "lost": "Locks lost while held (expired, taken over, renewals failed, max_hold).",
    "requeued": "Jobs requeued because their lock was busy.",
    "given_up": "Jobs failed with LockContentionTimeout after REQUEUE_MAX_WAIT.",
    "skipped": "Jobs skipped (on_conflict='skip') because their lock was busy.",
    "duplicates_blocked": "Duplicate runs blocked by an idempotency record.",
    "blocked_at_enqueue": "Duplicate .delay() calls of a unique job that returned the live job.",
    "stale_fence_rejections": "Writes refused by fenced_update (StaleFence).",
    "forced_releases": "Locks released by an operator (admin or joblock_release).",
}
HISTOGRAM_HELP = {
    "wait_seconds": "Time spent waiting for a lock, until acquired or given up.",
    "hold_seconds": "Time a lock was held, acquire to release.",
    "start_wait_seconds": "Time from a job's enqueue to the start of the run that took its lock.",
}
_NAMES = {"lost": "locks_lost"}


class JoblockCollector:
    """Collector reading django-joblock's Redis metrics at scrape time."""

    def collect(self) -> Iterator[Any]:
        totals = monitoring.totals()
        for metric, help_text in COUNTER_HELP.items():
            family = CounterMetricFamily(
                f"joblock_{_NAMES.get(metric, metric)}", help_text, labels=["family", "function"]
            )
            for (fam, func), value in sorted(totals.counters[metric].items()):
                family.add_metric([fam, func], value)
            yield family
        bounds = [*(f"{b:g}" for b in metrics.BOUNDS), "+Inf"]
        for metric, help_text in HISTOGRAM_HELP.items():
            histogram = HistogramMetricFamily(
                f"joblock_{metric}", help_text, labels=["family", "function"]
            )
            for (fam, func), counts in sorted(totals.histograms[metric].items()):
                cumulative, running = [], 0
                for bound, count in zip(bounds, counts, strict=True):
                    running += count
                    cumulative.append((bound, running))
                histogram.add_metric(
                    [fam, func], cumulative, totals.sums_us[metric][(fam, func)] / 1_000_000
                )
            yield histogram
        active = GaugeMetricFamily(
            "joblock_active_locks", "Locks held right now.", labels=["family"]
        )
        for fam, count in sorted(monitoring.active_counts().items()):
            active.add_metric([fam], count)
        yield active


def exposition() -> bytes:
    """The text exposition format of the collector's metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JoblockCollector())
    return generate_latest(registry)

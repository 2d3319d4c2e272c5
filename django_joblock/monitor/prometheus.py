"""Prometheus export (``pip install django-joblock[prometheus]``): a collector reading the
all-time totals and the active-lock index from Redis at scrape time, so every process's events
are in one place and workers keep no client state. Labels are ``family`` and ``function`` only
(never a resource id), so cardinality stays bounded."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from .. import metrics
from ..locks.index import active_counts


class JoblockCollector:
    def collect(self) -> Iterator[Any]:
        totals = metrics.totals()
        bounds = [*(f"{b:g}" for b in metrics.BOUNDS), "+Inf"]
        for metric in metrics.METRICS:
            name = f"joblock_{metric.exported or metric.name}"
            if metric.kind == metrics.COUNTER:
                family = CounterMetricFamily(name, metric.help, labels=["family", "function"])
                for (fam, func), value in sorted(totals.counters[metric.name].items()):
                    family.add_metric([fam, func], value)
                yield family
                continue
            histogram = HistogramMetricFamily(name, metric.help, labels=["family", "function"])
            for (fam, func), counts in sorted(totals.histograms[metric.name].items()):
                cumulative = list(zip(bounds, itertools.accumulate(counts), strict=True))
                seconds = totals.sums_us[metric.name][(fam, func)] / 1_000_000
                histogram.add_metric([fam, func], cumulative, seconds)
            yield histogram
        help_text = "Locks held right now (a lock with limit=N counts each of its holders)."
        held = GaugeMetricFamily("joblock_active_locks", help_text, labels=["family"])
        for fam, count in sorted(active_counts().items()):
            held.add_metric([fam], count)
        yield held


def exposition() -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JoblockCollector())
    return generate_latest(registry)

"""Everything the "Job locks" admin page shows, gathered from :mod:`monitoring` and
:mod:`health` (the admin only renders it).

Cost is bounded whatever the size: per-family ``ZCARD`` for counts, at most ``LOCK_ROWS``
index entries read in detail, 60 metric buckets in one pipeline, an indexed query for stuck
idempotency claims, and RQ's started registries read without cleanup. No ``SCAN``, no
``COUNT(*)`` over the idempotency table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from . import alerts, monitoring
from .health import DEAD, HEALTHY, Health, lock_health, stuck_claims, stuck_jobs

LOCK_ROWS = 100  # active locks shown in detail (per page render)
CHART_MINUTES = 60


@dataclass
class Bar:
    label: str
    value: float
    text: str
    x: float = 0.0
    y: float = 0.0
    width: float = 0.0
    height: float = 0.0


@dataclass
class Chart:
    title: str
    bars: list[Bar]
    kind: str = "h"  # "h": one bar per label; "t": one column per minute
    width: int = 420
    height: int = 0
    empty: str = "no data yet"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _hbar_chart(title: str, items: list[tuple[str, float, str]], note: str = "") -> Chart:
    top = max((value for _l, value, _t in items), default=0) or 1
    bars = []
    for index, (label, value, text) in enumerate(items):
        bars.append(
            Bar(
                label,
                value,
                text,
                x=110,
                y=index * 22 + 4,
                width=round(170 * value / top, 1),
                height=16,
            )
        )
    return Chart(title, bars, "h", width=460, height=len(items) * 22 + 8, note=note)


def _time_chart(title: str, series: list[tuple[int, int]], note: str = "") -> Chart:
    top = max((value for _s, value in series), default=0) or 1
    step = 420 / max(1, len(series))
    bars = []
    for index, (start, value) in enumerate(series):
        height = round(90 * value / top, 1)
        bars.append(
            Bar(
                time.strftime("%H:%M", time.localtime(start)),
                value,
                str(value),
                x=round(index * step, 1),
                y=100 - height,
                width=max(1.0, step - 1),
                height=height,
            )
        )
    return Chart(
        title,
        bars,
        "t",
        height=110,
        note=note,
        extra={
            "total": sum(v for _s, v in series),
            "peak": max((v for _s, v in series), default=0),
        },
    )


def build(
    family: str | None = None, health_filter: str | None = None, *, claims: bool = True
) -> dict[str, Any]:
    """The dashboard's context: cards, charts, active locks, stuck work, alerts.

    ``family`` must be a family name (validated by the caller), ``health_filter`` one of the
    :class:`~django_joblock.health.Health` values; ``claims=False`` leaves out the stuck
    idempotency claims (for users who may not see idempotency records).
    """
    started = time.perf_counter()
    hour = monitoring.window(3600)
    counts = monitoring.active_counts()
    attempts = hour.total("acquire_attempts")
    contended = hour.total("contended")
    fams = sorted(set(counts) | hour.families())
    contention = [
        (
            fam,
            hour.total("contended", fam) / hour.total("acquire_attempts", fam) * 100,
            f"{hour.total('contended', fam)}/{hour.total('acquire_attempts', fam)}",
        )
        for fam in fams
        if hour.total("acquire_attempts", fam)
    ]
    holds = []
    for fam in fams:
        merged = hour.merged_histogram("hold_seconds", fam)
        p95, p99 = monitoring.percentile(merged, 0.95), monitoring.percentile(merged, 0.99)
        if p95 is not None and p99 is not None:
            holds.append((fam, p99, f"p95 ≤ {p95:g}s, p99 ≤ {p99:g}s"))
    waits = []
    for fam in fams:
        merged = hour.merged_histogram("start_wait_seconds", fam)
        p50, p99 = monitoring.percentile(merged, 0.5), monitoring.percentile(merged, 0.99)
        if p50 is not None and p99 is not None:
            waits.append((fam, p99, f"p50 ≤ {p50:g}s, p99 ≤ {p99:g}s"))
    everywhere = hour.merged_histogram("start_wait_seconds")
    wait_p50 = monitoring.percentile(everywhere, 0.5)
    wait_p99 = monitoring.percentile(everywhere, 0.99)
    charts = [
        _hbar_chart(
            "Contention per family (last hour)",
            [(f, v, f"{v:.0f}% ({t})") for f, v, t in contention],
            "busy acquires / acquire attempts",
        ),
        _time_chart(
            "Requeues for contention per minute", monitoring.per_minute("requeued", CHART_MINUTES)
        ),
        _hbar_chart(
            "Hold time p95 / p99 per family (last hour)",
            holds,
            "bar = p99 bucket bound; accurate to one histogram bucket",
        ),
        _hbar_chart(
            "Active locks per family",
            [(f, c, str(c)) for f, c in sorted(counts.items(), key=lambda item: -item[1])],
        ),
        _time_chart(
            "Duplicates blocked by idempotency per minute",
            monitoring.per_minute("duplicates_blocked", CHART_MINUTES),
        ),
        _hbar_chart(
            "Wait from enqueue to start p50 / p99 per family (last hour)",
            waits,
            "jobs parked behind a busy resource or requeued wait longer; bar = p99 bucket bound",
        ),
    ]
    locks = monitoring.active_locks(family=family or None, limit=LOCK_ROWS, total=LOCK_ROWS)
    health = lock_health(locks)
    rows = []
    for held in locks:
        state = health.get(held.resource)
        if health_filter and (state is None or state.state.value != health_filter):
            continue
        rows.append(
            {
                "lock": held,
                "health": state.state.value if state is not None else HEALTHY.value,
                "why": state.why if state is not None else "",
                "ttl_left": max(0.0, held.pttl_ms / 1000),
            }
        )
    fired = alerts.evaluate()
    cards = [
        ("Active locks", sum(counts.values())),
        ("Families", len(counts)),
        ("Contention (1 h)", f"{contended / attempts * 100:.0f}%" if attempts else "-"),
        ("Requeues (1 h)", hour.total("requeued")),
        ("Duplicates blocked (1 h)", hour.total("duplicates_blocked")),
        ("Locks lost (1 h)", hour.total("lost")),
        ("Renew failures (1 h)", hour.total("renew_failed")),
        ("Jobs given up (1 h)", hour.total("given_up")),
        (
            "Wait to start p50 / p99 (1 h)",
            f"≤ {wait_p50:g}s / ≤ {wait_p99:g}s" if wait_p50 is not None and wait_p99 else "-",
        ),
    ]
    return {
        "cards": cards,
        "charts": charts,
        "rows": rows,
        "families": sorted(counts),
        "family": family or "",
        "health_filter": health_filter or "",
        "health_choices": [choice.value for choice in Health],
        "shown_limit": LOCK_ROWS,
        "stuck_jobs": stuck_jobs(),
        "dead_locks": [row for row in rows if row["health"] == DEAD.value],
        "stuck_claims": stuck_claims() if claims else [],
        "claims_shown": claims,
        "alerts": fired,
        "no_scheduler": [a for a in fired if a.name == "no_scheduler"],
        "build_ms": (time.perf_counter() - started) * 1000,
    }

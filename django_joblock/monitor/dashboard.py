"""Everything the "Job locks" admin page shows (the admin only renders it). The cost is bounded
whatever the size: per-family ``ZCARD`` counts, at most ``LOCK_ROWS`` index entries read in
detail, 60 metric buckets in one pipeline, indexed queries, RQ registries read without
cleanup, one family's history. No ``SCAN``, no ``COUNT(*)``; see docs/admin.md."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from .. import metrics
from ..jobs import history
from ..locks import index, keys
from . import active, alerts
from .charts import Chart, bar_chart, minute_chart, timeline_chart
from .health import Health, holder_health, queue_connections, stuck_claims, stuck_jobs

LOCK_ROWS = 100  # active locks shown in detail (per page render)
CHART_MINUTES = 60
TIMELINE_MINUTES = 10
TIMELINE_ROWS = 12  # resources drawn on the timeline (the most recently active)
CONTENTION_AXIS = "% of acquires that found the lock busy"
JOB_TYPE_COUNTERS = (  # the counters of the per-job-type table, in its column order
    "acquire_attempts",
    "contended",
    "requeued",
    "given_up",
    "duplicates_in_flight",
    "duplicates_blocked",
    "lost",
    "near_timeout",
    "failed_runs",
    "rq_retries",
)


def build(
    family: str | None = None,
    health_filter: str | None = None,
    *,
    claims: bool = True,
    outbox: bool = True,
    timeline_of: str | None = None,
) -> dict[str, Any]:
    """The page's context, for a ``family``, ``health_filter`` and ``timeline_of`` (a family or
    a resource; by default the busiest family) the caller validated; ``claims=False`` leaves out
    stuck idempotency claims, ``outbox=False`` the failing outbox message's key, handler and
    error from its alert (for users who may not see them)."""
    started = time.perf_counter()
    hour = metrics.window(3600)
    counts = index.active_counts()
    active_total = sum(counts.values())
    attempts = hour.total("acquire_attempts")
    contended = hour.busy()
    fams = sorted(set(counts) | hour.families())
    tries = {fam: (hour.busy(fam), hour.total("acquire_attempts", fam)) for fam in fams}
    contention = [(f, b / t * 100, f"{b / t:.0%} ({b}/{t})") for f, (b, t) in tries.items() if t]
    everywhere = hour.merged_histogram("start_wait_seconds")
    wait_p50 = metrics.percentile(everywhere, 0.5)
    wait_p99 = metrics.percentile(everywhere, 0.99)
    waits = f"≤ {wait_p50:g}s / ≤ {wait_p99:g}s" if wait_p50 is not None and wait_p99 else "-"

    def per_minute(title: str, metric: str, axis: str, note: str = "") -> Chart:
        return minute_chart(title, metrics.per_minute(metric, CHART_MINUTES), axis=axis, note=note)

    p99_axis = "seconds (p99 bucket bound)"
    retried_count = hour.total("rq_retries")
    retried = f"{retried_count} retried by RQ in the last hour"
    held_now = [(f, float(c), str(c)) for f, c in sorted(counts.items(), key=lambda fc: -fc[1])]
    charts = [
        bar_chart("Contention per family (last hour)", contention, axis=CONTENTION_AXIS),
        per_minute("Requeues for contention per minute", "requeued", "requeues"),
        per_minute("Failed runs per minute", "failed_runs", "failed runs", retried),
        bar_chart(
            "Hold time p95 / p99 per family (last hour)",
            _spread(hour, "hold_seconds", fams, 95),
            axis=p99_axis,
            note="accurate to one histogram bucket",
        ),
        bar_chart(
            "Active locks per family", held_now, axis="locks held now", empty="no active locks"
        ),
        per_minute(
            "Duplicates blocked by idempotency per minute", "duplicates_blocked", "duplicates"
        ),
        bar_chart(
            "Wait from enqueue to start p50 / p99 per family (last hour)",
            _spread(hour, "start_wait_seconds", fams, 50),
            axis=p99_axis,
            note="jobs parked behind a busy resource or requeued wait longer",
        ),
    ]
    locks = active.active_locks(family=family or None, limit=LOCK_ROWS, total=LOCK_ROWS)
    # A lock with a limit has a row per slot held: "slots used" counts them, read unfiltered.
    used = Counter(held.resource for held in locks)
    rows: list[dict[str, Any]] = []
    for held, found in zip(locks, holder_health(locks), strict=True):
        ttl_left = max(0.0, held.pttl_ms / 1000)
        rows.append(
            dict(
                lock=held,
                health=found.state.value,
                why=found.why,
                ttl_left=ttl_left,
                slots_used=used[held.resource],
            )
        )
    fired = alerts.evaluate(outbox_details=outbox)
    cards = [
        ("Active locks", active_total),
        ("Families (now or 1 h)", len(fams)),
        ("Contention (1 h)", f"{contended / attempts * 100:.0f}%" if attempts else "-"),
        ("Requeues (1 h)", hour.total("requeued")),
        ("Duplicates blocked (1 h)", hour.total("duplicates_blocked")),
        ("Locks lost (1 h)", hour.total("lost")),
        ("Renew failures (1 h)", hour.total("renew_failed")),
        ("Jobs given up (1 h)", hour.total("given_up")),
        ("Failed runs / RQ retries (1 h)", f"{hour.total('failed_runs')} / {retried_count}"),
        ("Wait to start p50 / p99 (1 h)", waits),
    ]
    target = timeline_of or _busiest(hour, counts)
    shown = [row for row in rows if not health_filter or row["health"] == health_filter]
    return {
        "cards": cards,
        "charts": charts,
        "timeline": _timeline(target) if target else None,
        "timeline_of": target,
        "job_types": job_types(hour),
        "rows": shown,
        "families": sorted(set(counts) | ({family} if family else set())),
        "family": family or "",
        "health_filter": health_filter or "",
        "health_choices": [choice.value for choice in Health],
        "shown": len(shown),
        "shown_of": counts.get(family, 0) if family else active_total,
        "shown_limit": LOCK_ROWS,
        "stuck_jobs": stuck_jobs(),
        # Every lock read, whatever the filter: a dead holder is stuck work.
        "dead_locks": [row for row in rows if row["health"] == Health.DEAD.value],
        "stuck_claims": stuck_claims() if claims else [],
        "claims_shown": claims,
        "alerts": fired,
        "no_scheduler": [a for a in fired if a.name == "no_scheduler"],
        "build_ms": (time.perf_counter() - started) * 1000,
    }


def _spread(hour: metrics.Series, metric: str, fams: list[str], low: int) -> list[Any]:
    """``(family, p99, "p<low> ≤ …, p99 ≤ …")`` of each family with samples of ``metric``."""
    found = []
    for fam in fams:
        merged = hour.merged_histogram(metric, fam)
        lower = metrics.percentile(merged, low / 100)
        p99 = metrics.percentile(merged, 0.99)
        if lower is not None and p99 is not None:
            found.append((fam, p99, f"p{low} ≤ {lower:g}s, p99 ≤ {p99:g}s"))
    return found


def _busiest(hour: metrics.Series, counts: dict[str, int]) -> str:
    """The family with the most contention in ``hour``, else the most active locks now."""
    contended = {fam: hour.busy(fam) for fam in hour.families()}
    ranked = contended if any(contended.values()) else counts
    return max(sorted(ranked), key=ranked.__getitem__, default="") or min(contended, default="")


def _timeline(target: str) -> Chart:
    """The timeline of a family, or of one resource (``target`` contains ``:``)."""
    fam = keys.family(target) if ":" in target else target  # a resource's family, or the family
    now = time.time()
    spans = history.read(queue_connections(), fam, since=now - TIMELINE_MINUTES * 60)
    title = f"Timeline of {target!r} (last {TIMELINE_MINUTES} minutes)"
    shown = [span for span in spans if target == fam or span.resource == target]
    note = "runs of @locked_job by workers: held, waited, busy, lost"
    return timeline_chart(
        title, shown, now=now, minutes=TIMELINE_MINUTES, rows=TIMELINE_ROWS, note=note
    )


def job_types(hour: metrics.Series) -> list[dict[str, Any]]:
    """One row per (job function, family) seen in ``hour``: its counters, contention and p99
    wait to start; busiest first. ``lock()`` calls outside a job have no function."""
    rows = []
    for fam, func in {label for name in JOB_TYPE_COUNTERS for label in hour.counters[name]}:
        counts = {name: hour.counters[name].get((fam, func), 0) for name in JOB_TYPE_COUNTERS}
        if not any(counts.values()):
            continue
        attempts = counts["acquire_attempts"]
        wait = hour.histograms["start_wait_seconds"].get((fam, func))
        p99 = metrics.percentile(wait, 0.99) if wait else None
        parked = hour.counters["parked"].get((fam, func), 0)
        found = min(counts["contended"] + parked, attempts)  # as metrics.Series.busy
        busy = f"{found / attempts * 100:.0f}%" if attempts else "-"
        row = {"func": func or "(lock() outside a job)", "family": fam, **counts, "busy": busy}
        rows.append({**row, "wait_p99": f"≤ {p99:g}s" if p99 is not None else "-"})
    return sorted(rows, key=lambda row: (-row["contended"], -row["requeued"], row["func"]))

"""Inline SVG charts for the "Job locks" page, drawn server-side (no JavaScript), with axes,
tick labels and axis titles: bars per family, columns per minute, and a timeline of the runs
per resource. A chart of zeros has no bars (the page says "no data" instead of a flat line).
Numbers are SVG user units; the template only places them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.utils import timezone

WIDTH = 460
LABEL_WIDTH = 112  # bar charts: room for the family names
BAR_ROW = 22
BAR_SPAN = 250  # longest bar, when its value's text fits beside it
PLOT_LEFT = 40  # minute charts: room for the count labels
PLOT_TOP = 8
PLOT_HEIGHT = 100
TICK_EVERY = 15  # minutes between time labels
LAST_LABEL_MINUTES = 8  # no quarter-hour label this close to the (right-aligned) last one
TIMELINE_WIDTH = 920
TIMELINE_LABEL = 130  # room for the resource names
TIMELINE_ROW = 18
BUSY_OUTCOMES = frozenset({"requeued", "skipped", "gave_up"})  # a mark (found busy), not a bar
Frame = tuple[float, float, float, float]  # left, top, bottom, right


@dataclass
class Bar:
    label: str
    text: str  # shown next to the bar and in its tooltip
    x: float = 0.0
    y: float = 0.0
    width: float = 0.0
    height: float = 0.0
    css: str = ""  # timeline: the outcome's class (jl-tl-<outcome>, jl-tl-wait, jl-tl-busy)


@dataclass
class Tick:
    x: float
    y: float
    text: str
    anchor: str = "middle"  # SVG text-anchor
    rotate: bool = False  # a vertical axis title


@dataclass
class Chart:
    title: str
    kind: str  # "bars", "minutes" or "timeline"
    bars: list[Bar]
    width: int = WIDTH
    height: int = 0
    note: str = ""
    empty: str = "no data"
    axes: list[tuple[float, float, float, float]] = field(default_factory=list)  # x1 y1 x2 y2
    ticks: list[Tick] = field(default_factory=list)
    summary: str = ""

    @property
    def has_data(self) -> bool:
        return bool(self.bars)


def _number(value: float) -> str:
    """A tick label: whole numbers as they are, others to three significant digits."""
    return f"{int(value):,}" if float(value).is_integer() else f"{value:.3g}"


def _framed(chart: Chart, frame: Frame, ticks: list[Tick], summary: str) -> Chart:
    """``chart`` with its ticks, its vertical axis at ``left`` from ``top`` and its horizontal
    one at ``bottom`` to ``right`` (``frame``), and room for two rows of labels under it."""
    left, top, bottom, right = frame
    chart.axes = [(left, top, left, bottom), (left, bottom, right, bottom)]
    chart.height = int(bottom + 38)
    chart.ticks = ticks
    chart.summary = summary
    return chart


def _local(at: float) -> datetime:
    return datetime.fromtimestamp(at, UTC).astimezone(timezone.get_current_timezone())


def _time_title(x: float, y: float) -> Tick:
    """The time axis's title, naming the zone of its labels (the current time zone, as
    :func:`_local` uses; with ``USE_TZ = False`` too, where ``timezone.now()`` is naive)."""
    zone = _local(time.time()).tzname() or ""
    return Tick(x, y, f"time ({zone})")


def bar_chart(
    title: str,
    items: list[tuple[str, float, str]],
    *,
    axis: str,
    note: str = "",
    empty: str = "no data in the last hour",
) -> Chart:
    """Horizontal bars for ``[(label, value, text)]``; ``axis`` names the value axis."""
    shown = [item for item in items if item[1] > 0]
    if not shown:
        return Chart(title, "bars", [], note=note, empty=empty)
    top = max(value for _label, value, _text in shown)
    # Each value's text goes right of its bar (~6.5 px a character at 11 px): long texts
    # shorten the bars rather than run past the chart's edge, which clips them.
    room = WIDTH - LABEL_WIDTH - 8
    fits = (max(60.0, (room - 6.5 * len(text)) * top / value) for _l, value, text in shown)
    span = round(min(BAR_SPAN, *fits), 1)
    bars = []
    for row, (label, value, text) in enumerate(shown):
        width = round(max(1.0, span * value / top), 1)
        bars.append(Bar(label, text, LABEL_WIDTH, PLOT_TOP + row * BAR_ROW, width, BAR_ROW - 6))
    bottom = PLOT_TOP + len(shown) * BAR_ROW
    ticks = [
        Tick(LABEL_WIDTH, bottom + 14, "0"),
        Tick(LABEL_WIDTH + span, bottom + 14, _number(top)),
        Tick(LABEL_WIDTH + span / 2, bottom + 30, axis),
    ]
    frame = (LABEL_WIDTH, PLOT_TOP - 2, bottom, LABEL_WIDTH + span)
    summary = f"{len(shown)} row(s); largest {_number(top)}"
    return _framed(Chart(title, "bars", bars, note=note), frame, ticks, summary)


def minute_chart(title: str, series: list[tuple[int, int]], *, axis: str, note: str = "") -> Chart:
    """One column per minute of ``[(minute_start_unix, count)]`` (oldest first)."""
    total = sum(value for _start, value in series)
    minutes = len(series)
    if not total:
        empty = f"no data in the last {minutes} minutes"
        return Chart(title, "minutes", [], note=note, empty=empty)
    peak = max(value for _start, value in series)
    plot_width = WIDTH - PLOT_LEFT - 8
    step = plot_width / max(1, minutes)
    bottom = PLOT_TOP + PLOT_HEIGHT
    bars = []
    ticks = [
        Tick(PLOT_LEFT - 4, bottom + 4, "0", "end"),
        Tick(PLOT_LEFT - 4, PLOT_TOP + 8, _number(peak), "end"),
    ]
    for index, (start, value) in enumerate(series):
        at = _local(start)
        label = at.strftime("%H:%M")
        height = round(PLOT_HEIGHT * value / peak, 1)
        x = round(PLOT_LEFT + index * step, 1)
        bars.append(Bar(label, f"{value}", x, bottom - height, max(1.0, step - 1), height))
        left = minutes - 1 - index  # minutes after this one
        if not left:  # right-aligned to the plot's end, so the SVG never clips it
            ticks.append(Tick(round(x + step, 1), bottom + 14, label, "end"))
        # A quarter-hour label this close to the last one (a label's width) would print over it.
        elif at.minute % TICK_EVERY == 0 and left >= LAST_LABEL_MINUTES:
            ticks.append(Tick(round(x + step / 2, 1), bottom + 14, label))
    ticks.append(_time_title(PLOT_LEFT + plot_width / 2, bottom + 30))
    ticks.append(Tick(12, PLOT_TOP + PLOT_HEIGHT / 2, axis, "middle", rotate=True))
    frame = (PLOT_LEFT, PLOT_TOP, bottom, PLOT_LEFT + plot_width)
    summary = f"last {minutes} minutes: total {total}, peak {peak}/min"
    return _framed(Chart(title, "minutes", bars, note=note), frame, ticks, summary)


def timeline_chart(
    title: str, spans: list[Any], *, now: float, minutes: int, rows: int, note: str = ""
) -> Chart:
    """The ``rows`` most recently active resources (newest first) over the ``minutes`` before
    ``now`` (Unix seconds), from :class:`~django_joblock.jobs.history.Delivery`-like spans."""
    start = now - minutes * 60
    shown = [span for span in spans if span.started + span.took >= start]
    if not shown:
        empty = f"no runs with a lock in the last {minutes} minutes"
        return Chart(title, "timeline", [], width=TIMELINE_WIDTH, note=note, empty=empty)
    latest: dict[str, float] = {}
    for span in shown:
        latest[span.resource] = max(latest.get(span.resource, 0.0), span.started + span.took)
    names = sorted(latest, key=lambda resource: -latest[resource])[:rows]
    row_of = {resource: index for index, resource in enumerate(names)}
    plot = TIMELINE_WIDTH - TIMELINE_LABEL - 10

    def x_of(at: float) -> float:
        return round(TIMELINE_LABEL + plot * (min(max(at, start), now) - start) / (now - start), 1)

    bars: list[Bar] = []
    for span in shown:
        if span.resource not in row_of:
            continue
        y = PLOT_TOP + row_of[span.resource] * TIMELINE_ROW
        x0 = x_of(span.started)
        after = f" after waiting {span.waited:g}s" if span.waited else ""
        what = f"job {span.job_id} ({span.func}): {span.outcome}, ran {span.took:g}s{after}"
        if span.waited:
            x_wait = x_of(span.started - span.waited)
            waited = f"job {span.job_id} waited {span.waited:g}s"
            # Under the row's bars: a wait overlaps a holder.
            line = (x_wait, y + TIMELINE_ROW - 4, max(1.0, x0 - x_wait), 2)
            bars.append(Bar(span.resource, waited, *line, css="jl-tl-wait"))
        if span.outcome in BUSY_OUTCOMES:
            mark = (x0 - 1, y + 3, 3, TIMELINE_ROW - 8)
            bars.append(Bar(span.resource, what, *mark, css="jl-tl-busy"))
        else:
            run = (x0, y + 1, max(4.0, x_of(span.started + span.took) - x0), TIMELINE_ROW - 6)
            bars.append(Bar(span.resource, what, *run, css=f"jl-tl-{span.outcome}"))
    bottom = PLOT_TOP + len(names) * TIMELINE_ROW
    short = [name if len(name) <= 20 else name[:19] + "…" for name in names]
    ticks = [
        Tick(TIMELINE_LABEL - 6, PLOT_TOP + index * TIMELINE_ROW + 12, name, "end")
        for index, name in enumerate(short)
    ]
    for minute in range(minutes + 1):
        if minute % max(1, minutes // 5) == 0 or minute == minutes:
            anchor = "end" if minute == minutes else ("start" if minute == 0 else "middle")
            at = start + minute * 60
            ticks.append(Tick(x_of(at), bottom + 14, _local(at).strftime("%H:%M:%S"), anchor))
    ticks.append(_time_title(TIMELINE_LABEL + plot / 2, bottom + 30))
    held = sum(1 for span in shown if span.outcome not in BUSY_OUTCOMES)
    lost = sum(1 for span in shown if span.outcome == "aborted")
    more = f" (and {len(latest) - len(names)} more)" if len(latest) > len(names) else ""
    frame = (TIMELINE_LABEL, PLOT_TOP - 2, bottom, TIMELINE_LABEL + plot)
    summary = (
        f"{len(names)} resource(s){more}: {held} run(s) holding the lock, "
        f"{len(shown) - held} found it busy, {lost} lost it"
    )
    chart = Chart(title, "timeline", bars, width=TIMELINE_WIDTH, note=note)
    return _framed(chart, frame, ticks, summary)

"""Chart geometry for the "Job locks" page: inline SVG drawn server-side (no JavaScript).

Three kinds, all with axes, tick labels and axis titles:

- :func:`bar_chart`: one horizontal bar per label (a family), the value axis underneath;
- :func:`minute_chart`: one column per minute, a time axis with clock labels in the current
  Django time zone, a count axis on the left;
- :func:`timeline_chart`: one row per resource over the last minutes, each run a bar from its
  start to its release (coloured by outcome), its wait from enqueue a thin line under the row
  before it, and a run that found the resource busy a mark.

A chart whose values are all zero has no bars: the page says "no data" instead of drawing a
flat line that looks like a broken chart. The numbers here are SVG user units; the template
only places what this module computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.utils import timezone

WIDTH = 460
LABEL_WIDTH = 112  # bar charts: room for the family names
BAR_ROW = 22
BAR_SPAN = 250  # longest bar
PLOT_LEFT = 40  # minute charts: room for the count labels
PLOT_TOP = 8
PLOT_HEIGHT = 100
TICK_EVERY = 15  # minutes between time labels
LAST_LABEL_MINUTES = 8  # no quarter-hour label this close to the (right-aligned) last one


@dataclass
class Bar:
    label: str
    value: float
    text: str  # shown next to the bar and in its tooltip
    x: float = 0.0
    y: float = 0.0
    width: float = 0.0
    height: float = 0.0
    css: str = ""  # timeline: the outcome's class (jl-tl-<outcome>, jl-tl-wait)


@dataclass
class Tick:
    x: float
    y: float
    text: str
    anchor: str = "middle"  # SVG text-anchor
    rotate: bool = False  # a vertical axis title


@dataclass
class Line:
    x1: float
    y1: float
    x2: float
    y2: float


@dataclass
class Chart:
    title: str
    kind: str  # "bars", "minutes" or "timeline"
    bars: list[Bar]
    width: int = WIDTH
    height: int = 0
    note: str = ""
    empty: str = "no data"
    axes: list[Line] = field(default_factory=list)
    ticks: list[Tick] = field(default_factory=list)
    summary: str = ""

    @property
    def has_data(self) -> bool:
        return bool(self.bars)


def _number(value: float) -> str:
    """A tick label: whole numbers as they are, others to three significant digits."""
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:.3g}"


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
    bars = [
        Bar(
            label,
            value,
            text,
            x=LABEL_WIDTH,
            y=PLOT_TOP + index * BAR_ROW,
            width=round(max(1.0, BAR_SPAN * value / top), 1),
            height=BAR_ROW - 6,
        )
        for index, (label, value, text) in enumerate(shown)
    ]
    baseline = PLOT_TOP + len(shown) * BAR_ROW
    axes = [
        Line(LABEL_WIDTH, PLOT_TOP - 2, LABEL_WIDTH, baseline),
        Line(LABEL_WIDTH, baseline, LABEL_WIDTH + BAR_SPAN, baseline),
    ]
    ticks = [
        Tick(LABEL_WIDTH, baseline + 14, "0"),
        Tick(LABEL_WIDTH + BAR_SPAN, baseline + 14, _number(top)),
        Tick(LABEL_WIDTH + BAR_SPAN / 2, baseline + 30, axis),
    ]
    return Chart(
        title,
        "bars",
        bars,
        height=int(baseline + 38),
        note=note,
        axes=axes,
        ticks=ticks,
        summary=f"{len(shown)} row(s); largest {_number(top)}",
    )


def minute_chart(title: str, series: list[tuple[int, int]], *, axis: str, note: str = "") -> Chart:
    """One column per minute of ``[(minute_start_unix, count)]`` (oldest first)."""
    total = sum(value for _start, value in series)
    minutes = len(series)
    empty = f"no data in the last {minutes} minutes"
    if not total:
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
    zone = timezone.get_current_timezone()
    for index, (start, value) in enumerate(series):
        at = datetime.fromtimestamp(start, UTC).astimezone(zone)
        label = at.strftime("%H:%M")
        height = round(PLOT_HEIGHT * value / peak, 1)
        x = round(PLOT_LEFT + index * step, 1)
        width = max(1.0, step - 1)
        bars.append(
            Bar(label, value, f"{value}", x=x, y=bottom - height, width=width, height=height)
        )
        last = index == minutes - 1
        # A quarter-hour label this close to the last minute's (about a label's width at the
        # chart's width and font) would print over it.
        crowded = minutes - 1 - index < LAST_LABEL_MINUTES
        if last:  # right-aligned to the plot's end, so the SVG never clips it
            ticks.append(Tick(round(x + step, 1), bottom + 14, label, "end"))
        elif at.minute % TICK_EVERY == 0 and not crowded:
            ticks.append(Tick(round(x + step / 2, 1), bottom + 14, label))
    zone_name = timezone.localtime(timezone.now(), zone).tzname() or ""
    ticks.append(Tick(PLOT_LEFT + plot_width / 2, bottom + 30, f"time ({zone_name})"))
    ticks.append(Tick(12, PLOT_TOP + PLOT_HEIGHT / 2, axis, "middle", rotate=True))
    axes = [
        Line(PLOT_LEFT, PLOT_TOP, PLOT_LEFT, bottom),
        Line(PLOT_LEFT, bottom, PLOT_LEFT + plot_width, bottom),
    ]
    return Chart(
        title,
        "minutes",
        bars,
        height=bottom + 38,
        note=note,
        axes=axes,
        ticks=ticks,
        summary=f"last {minutes} minutes: total {total}, peak {peak}/min",
    )


TIMELINE_WIDTH = 920
TIMELINE_LABEL = 130  # room for the resource names
TIMELINE_ROW = 18
#: Outcomes drawn as a mark (the run found the resource busy) rather than a held bar.
BUSY_OUTCOMES = frozenset({"requeued", "skipped", "gave_up"})


def timeline_chart(
    title: str, spans: list[Any], *, now: float, minutes: int, rows: int, note: str = ""
) -> Chart:
    """Rows of resources (the ``rows`` most recently active; newest first) over the last
    ``minutes`` before ``now`` (Unix seconds), from :class:`~django_joblock.timeline.Span`-like
    objects (``resource``, ``job_id``, ``func``, ``started``, ``took``, ``waited``,
    ``outcome``)."""
    start = now - minutes * 60
    shown = [span for span in spans if span.started + span.took >= start]
    if not shown:
        return Chart(
            title,
            "timeline",
            [],
            width=TIMELINE_WIDTH,
            note=note,
            empty=(f"no runs with a lock in the last {minutes} minutes"),
        )
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
        row = row_of.get(span.resource)
        if row is None:
            continue
        y = PLOT_TOP + row * TIMELINE_ROW
        what = f"job {span.job_id} ({span.func}): {span.outcome}, ran {span.took:g}s"
        if span.waited:
            what += f" after waiting {span.waited:g}s"
            x0, x1 = x_of(span.started - span.waited), x_of(span.started)
            bars.append(
                Bar(
                    span.resource,
                    span.waited,
                    f"job {span.job_id} waited {span.waited:g}s",
                    x=x0,
                    y=y + TIMELINE_ROW - 4,  # under the row's bars: a wait overlaps a holder
                    width=max(1.0, x1 - x0),
                    height=2,
                    css="jl-tl-wait",
                )
            )
        x0 = x_of(span.started)
        if span.outcome in BUSY_OUTCOMES:
            bars.append(
                Bar(
                    span.resource,
                    0,
                    what,
                    x=x0 - 1,
                    y=y + 3,
                    width=3,
                    height=TIMELINE_ROW - 8,
                    css="jl-tl-busy",
                )
            )
            continue
        width = max(2.0, x_of(span.started + span.took) - x0)
        bars.append(
            Bar(
                span.resource,
                span.took,
                what,
                x=x0,
                y=y + 1,
                width=width,
                height=TIMELINE_ROW - 6,
                css=f"jl-tl-{span.outcome}",
            )
        )
    bottom = PLOT_TOP + len(names) * TIMELINE_ROW
    ticks = [
        Tick(TIMELINE_LABEL - 6, PLOT_TOP + index * TIMELINE_ROW + 12, _short(name), "end")
        for index, name in enumerate(names)
    ]
    zone = timezone.get_current_timezone()
    for minute in range(minutes + 1):
        at = start + minute * 60
        if minute % max(1, minutes // 5) == 0 or minute == minutes:
            label = datetime.fromtimestamp(at, UTC).astimezone(zone).strftime("%H:%M:%S")
            anchor = "end" if minute == minutes else ("start" if minute == 0 else "middle")
            ticks.append(Tick(x_of(at), bottom + 14, label, anchor))
    zone_name = timezone.localtime(timezone.now(), zone).tzname() or ""
    ticks.append(Tick(TIMELINE_LABEL + plot / 2, bottom + 30, f"time ({zone_name})"))
    axes = [
        Line(TIMELINE_LABEL, PLOT_TOP - 2, TIMELINE_LABEL, bottom),
        Line(TIMELINE_LABEL, bottom, TIMELINE_LABEL + plot, bottom),
    ]
    held = sum(1 for span in shown if span.outcome not in BUSY_OUTCOMES)
    busy = len(shown) - held
    more = len(latest) - len(names)
    return Chart(
        title,
        "timeline",
        bars,
        width=TIMELINE_WIDTH,
        height=int(bottom + 38),
        note=note,
        axes=axes,
        ticks=ticks,
        summary=(
            f"{len(names)} resource(s){f' (and {more} more)' if more else ''}: {held} run(s) "
            f"holding the lock, {busy} found it busy, "
            f"{sum(1 for span in shown if span.outcome == 'aborted')} lost it"
        ),
    )


def _short(name: str, limit: int = 20) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"

"""Chart geometry for the "Job locks" page: inline SVG drawn server-side (no JavaScript).

Two kinds, both with axes, tick labels and axis titles:

- :func:`bar_chart`: one horizontal bar per label (a family), the value axis underneath;
- :func:`minute_chart`: one column per minute, a time axis with clock labels in the current
  Django time zone, a count axis on the left.

A chart whose values are all zero has no bars: the page says "no data" instead of drawing a
flat line that looks like a broken chart. The numbers here are SVG user units; the template
only places what this module computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

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
    kind: str  # "bars" or "minutes"
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

"""The dashboard's SVG chart geometry: axes, labels, and "no data" instead of flat charts."""

from __future__ import annotations

import pytest
from django.utils import timezone

from django_joblock.monitor.charts import WIDTH, bar_chart, minute_chart

MINUTE = 60


def test_all_zero_series_draw_no_chart_but_say_no_data():
    series = [(1_700_000_000 + i * MINUTE, 0) for i in range(60)]
    chart = minute_chart("Requeues", series, axis="requeues")
    assert not chart.has_data and chart.empty == "no data in the last 60 minutes"
    assert not bar_chart("Contention", [("order", 0.0, "0%")], axis="%").has_data


def test_minute_chart_labels_its_axes_in_the_current_time_zone(settings):
    settings.TIME_ZONE = "Asia/Jakarta"  # UTC+7, no daylight saving
    start = 1_700_000_000 // 3600 * 3600  # a whole UTC hour
    series = [(start + i * MINUTE, i % 4) for i in range(60)]
    with timezone.override("Asia/Jakarta"):
        chart = minute_chart("Requeues", series, axis="requeues")
    texts = [tick.text for tick in chart.ticks]
    hour = (start // 3600 + 7) % 24
    assert f"{hour:02d}:00" in texts and f"{hour:02d}:15" in texts and f"{hour:02d}:59" in texts
    assert "time (WIB)" in texts and "requeues" in texts
    assert "3" in texts and "0" in texts  # the count axis: 0 and the peak
    assert len(chart.bars) == 60 and max(bar.height for bar in chart.bars) == 100
    assert chart.summary == f"last 60 minutes: total {sum(v for _s, v in series)}, peak 3/min"


def test_bar_chart_has_a_value_axis_and_readable_tick_labels():
    chart = bar_chart(
        "Contention", [("order", 100 * 25 / 26, "96%"), ("tenant", 10.0, "10%")], axis="% busy"
    )
    assert [bar.label for bar in chart.bars] == ["order", "tenant"]
    assert chart.bars[0].width > chart.bars[1].width > 0
    assert [tick.text for tick in chart.ticks] == ["0", "96.2", "% busy"]
    assert len(chart.axes) == 2


@pytest.mark.parametrize(("end", "quarter_shown"), [(46, False), (52, False), (54, True)])
def test_a_quarter_hour_label_next_to_the_last_minute_is_left_out(end, quarter_shown):
    """The last minute is always labelled, right-aligned to the plot's end (centred, the SVG
    clipped it); a quarter-hour label less than 8 minutes before it would print over it
    (seen as "07:4546" in the browser screenshot)."""
    start = 1_700_000_000 // 3600 * 3600 - (59 - end) * MINUTE  # 60 minutes ending at hh:end
    series = [(start + i * MINUTE, 1) for i in range(60)]
    with timezone.override("UTC"):
        chart = minute_chart("Requeues", series, axis="n")
    minutes = [tick for tick in chart.ticks if ":" in tick.text]
    assert minutes[-1].text.endswith(f":{end}") and minutes[-1].anchor == "end"
    assert abs(minutes[-1].x - (WIDTH - 8)) < 1, "at the plot's right end"
    assert any(tick.text.endswith(":45") for tick in minutes) is quarter_shown
    assert any(tick.text.endswith(":30") for tick in minutes)

"""A real browser (Playwright driving Debian's headless chromium) walks the dashboard:
log in, see a contended lock and a stuck job, force-release the lock with a reason.

Screenshots go to ``artifacts/`` (git-ignored). Never downloads a browser: it needs
``/usr/bin/chromium`` (``apt-get install chromium``; ``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from rq.job import JobStatus

from django_joblock import lock, metrics
from tests import jobs
from tests.harness import wait_for
from tests.workers import Workers

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
CHROMIUM = os.environ.get("JOBLOCK_CHROMIUM", "/usr/bin/chromium")


def _stuck_job(rconn, workers: Workers):  # type: ignore[no-untyped-def]
    """A job left 'started' by a worker and horse that were SIGKILLed, past its timeout. The job
    ignores its timeout: on a busy machine a horse could reach it before the kill."""
    worker = workers.start()
    job = jobs.hold_past_timeout.enqueue_call((42, "stuck", 60.0), job_timeout=2)
    assert wait_for(lambda: rconn.get("test:pid:stuck"), 20), workers.logs()
    os.kill(int(rconn.get("test:pid:stuck")), signal.SIGKILL)
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(10)
    time.sleep(2.5)  # past its 2 s timeout, still in RQ's started registry
    assert job.get_status(refresh=True) == JobStatus.STARTED, "the kill left it started"
    return job


# Relative luminance and contrast ratio (WCAG 2.x) of CSS colours as the browser computed them.
CONTRAST_JS = """
([selector, backgroundOf]) => {
  const parse = (c) => c.match(/[\\d.]+/g).map(Number);
  const lum = ([r, g, b]) => {
    const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const el = document.querySelector(selector);
  let bg = el, color;
  while (bg) {
    color = getComputedStyle(bg).backgroundColor;
    const parts = parse(color);
    if (parts.length < 4 || parts[3] > 0) break;
    bg = bg.parentElement;
  }
  const fg = lum(parse(getComputedStyle(el).color));
  const back = lum(parse(bg ? color : "rgb(255, 255, 255)"));
  return (Math.max(fg, back) + 0.05) / (Math.min(fg, back) + 0.05);
}
"""


def _check_polish(page, base_url: str, stuck_id: str) -> None:  # type: ignore[no-untyped-def]
    """Breadcrumbs styled like the admin's own, charts with axes or a "no data" note, the
    row count said plainly, the runbook linked online, RQ job ids linked to django-rq."""
    from django_joblock.admin.records import rq_job_url

    crumbs = page.eval_on_selector(
        ".breadcrumbs", "e => [getComputedStyle(e).backgroundColor, getComputedStyle(e).padding]"
    )
    assert "Job locks" in page.inner_text(".breadcrumbs")
    assert "django-joblock" in page.inner_text(".breadcrumbs"), "app section named apart"
    charts = page.inner_text("#jl-charts")
    assert "no data in the last 60 minutes" in charts  # requeues: none happened
    contention = page.locator("figure.jl-chart", has_text="Contention per family")
    ticks = contention.locator("text.jl-tick").all_text_contents()
    assert "0" in ticks and any("busy" in tick for tick in ticks), ticks
    duplicates = page.locator("figure.jl-chart", has_text="Duplicates blocked")
    ticks = duplicates.locator("text.jl-tick").all_text_contents()
    assert "3" in ticks and any(tick.startswith("time (") for tick in ticks), ticks
    assert any(re.fullmatch(r"\d\d:\d\d", tick) for tick in ticks), ticks
    assert page.inner_text("#jl-shown").startswith("showing 1 of 1 active lock,")
    footer = page.get_attribute("#jl-footer a", "href")
    assert footer and footer.startswith("https://"), footer
    expected = rq_job_url("default", stuck_id)
    links = page.locator(f"#jl-stuck a.jl-job:has-text('{stuck_id}')")
    if expected:
        assert links.get_attribute("href") == expected
    else:
        assert links.count() == 0, "no django-rq page to link to on this django-rq"
    page.goto(f"{base_url}/admin/django_joblock/idempotencyrecord/")
    theirs = page.eval_on_selector(
        ".breadcrumbs", "e => [getComputedStyle(e).backgroundColor, getComputedStyle(e).padding]"
    )
    assert crumbs == theirs, f"breadcrumbs styled unlike the admin's own: {crumbs} vs {theirs}"
    if expected:
        page.goto(f"{base_url}{expected}")
        assert stuck_id in page.content(), "the linked django-rq page shows the job"
    page.goto(f"{base_url}/admin/django_joblock/dashboard/")
    page.wait_for_selector("#joblock-dashboard")


def _timeline_spans(rconn) -> None:  # type: ignore[no-untyped-def]
    """What workers write when runs end (tests/test_timeline.py has them write it for real):
    two resources of family "order" over the last minutes, every outcome the chart draws."""
    from tests.harness import write_run

    now = time.time()
    spans = [
        ("order:777", "job-a", -300, 40.0, None, "ran"),
        ("order:777", "job-b", -290, 0.0, None, "requeued"),
        ("order:777", "job-b", -258, 12.0, 33.0, "ran"),
        ("order:777", "job-c", -200, 30.0, 5.0, "aborted"),
        ("order:778", "job-d", -150, 20.0, None, "failed"),
        ("order:778", "job-e", -100, 25.0, 2.0, "replayed"),
    ]
    for resource, job_id, ago, took, waited, outcome in spans:
        write_run(rconn, resource, job_id, "shop.jobs.refund", now + ago, took, waited, outcome)


def _check_timeline(page) -> None:  # type: ignore[no-untyped-def]
    """The timeline of the busiest family: rows per resource, a bar per run, the legend."""
    section = page.locator("#jl-timeline")
    assert "Timeline of 'order'" in section.inner_text()
    assert section.locator("rect.jl-tl-ran").count() == 2
    assert section.locator("rect.jl-tl-aborted").count() == 1
    assert section.locator("rect.jl-tl-busy").count() == 1
    ticks = section.locator("text.jl-tick").all_text_contents()
    assert "order:777" in ticks and "order:778" in ticks, ticks
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d", tick) for tick in ticks), ticks
    section.screenshot(path=str(ARTIFACTS / "4-timeline.png"))


CLIPPED_JS = """() => [...document.querySelectorAll('#joblock-dashboard svg text')].flatMap(t => {
  const svg = t.ownerSVGElement.getBoundingClientRect(), box = t.getBoundingClientRect();
  const out = box.left < svg.left - 0.5 || box.right > svg.right + 0.5;
  return out ? [`${t.textContent} (${box.left | 0}..${box.right | 0} in ${svg.left | 0}..`
    + `${svg.right | 0})`] : [];
})"""


def _check_chart_text_fits(page) -> None:  # type: ignore[no-untyped-def]
    """No label, value or tick of a chart runs past its SVG's edge (the SVG clips it): the
    longest bar's "p95 ≤ …, p99 ≤ …" was cut off in every bar chart."""
    values = page.locator("#joblock-dashboard svg text.jl-value").all_text_contents()
    assert any("p99" in value for value in values), values  # the long ones are drawn
    assert page.evaluate(CLIPPED_JS) == []


def _check_dark_and_narrow(page) -> None:  # type: ignore[no-untyped-def]
    """Status colours readable in light and dark themes; nothing wider than a phone."""
    for scheme in ("light", "dark"):
        page.emulate_media(color_scheme=scheme)
        page.reload()
        page.wait_for_selector("#joblock-dashboard")
        ratio = page.evaluate(CONTRAST_JS, ["#jl-locks tr.jl-health-healthy .jl-health", None])
        assert ratio >= 4.5, f"{scheme}: healthy status contrast {ratio:.2f} < 4.5"
        ratio = page.evaluate(CONTRAST_JS, ["#jl-alerts .jl-alert", None])
        assert ratio >= 4.5, f"{scheme}: alert contrast {ratio:.2f} < 4.5"
        if scheme == "dark":
            page.screenshot(path=str(ARTIFACTS / "1b-dashboard-dark.png"), full_page=True)
    page.emulate_media(color_scheme="light")
    page.set_viewport_size({"width": 390, "height": 900})
    page.reload()
    page.wait_for_selector("#joblock-dashboard")
    page.screenshot(path=str(ARTIFACTS / "1c-dashboard-narrow.png"), full_page=True)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, f"the page is {width}px wide at a 390px viewport"
    # The tables scroll sideways in their own box, which shows it with an edge shadow.
    wrapper = page.locator("div.jl-scroll:has(#jl-locks)")
    assert wrapper.evaluate("e => e.scrollWidth > e.clientWidth"), "the table fits: no test"
    shadow = wrapper.evaluate("e => getComputedStyle(e).backgroundImage")
    assert shadow.count("radial-gradient") == 2, shadow
    wrapper.screenshot(path=str(ARTIFACTS / "1d-table-scrolls.png"))
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.reload()
    page.wait_for_selector("#joblock-dashboard")
    # At 1,400 px the health and the Force release link were past the table's right edge.
    for shown in ("td.jl-health", "a.jl-release"):
        box = page.locator(f"#jl-locks tr:has-text('order:777') {shown}").bounding_box()
        assert box is not None and box["x"] + box["width"] <= 1400, f"{shown} off-screen: {box}"


CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _contended_lock_and_metrics(rconn, held) -> None:  # type: ignore[no-untyped-def]
    """What the dashboard shows: ``held`` taken and contended 25 times, duplicates blocked,
    hold and start-wait times of three families, and timeline spans."""
    assert held.acquire()
    # What a worker's holding shows (RQ's 32-character job id and worker name, a dotted job
    # function, a container's host name): as wide as a row gets in production.
    holder = {
        "job_id": "5f0c3a9e1b7d4e2f8a6c0b9d3e1f7a2c",
        "job_func": "shop.payments.jobs.refund_order_after_the_payment_provider_confirmed",
        "worker": "9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b",
        "host": "shop-worker-7d9f8c6b5-x2k4p.eu-central-1.compute.internal",
    }
    rconn.hset(held.key, mapping=holder)
    for _ in range(25):  # contention on the held lock
        assert not lock("order:777").acquire()
    metrics.count("duplicates_blocked", "refund", "tests.jobs.credit", 3)
    for family, seconds in (("order", 12.5), ("refund", 0.75), ("mail", 240.0)):
        metrics.observe("hold_seconds", family, "tests.jobs.credit", seconds)
        metrics.observe("start_wait_seconds", family, "tests.jobs.credit", seconds / 3)
    metrics.flush_now()
    _timeline_spans(rconn)
    assert wait_for(lambda: rconn.zcard("joblock:active:order"), 3)


def _log_in(page, base_url: str) -> None:  # type: ignore[no-untyped-def]
    """Log in as ``ops`` through the admin's login form, which leads to the dashboard."""
    page.goto(f"{base_url}/admin/login/?next=/admin/django_joblock/dashboard/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_selector("#joblock-dashboard")


def _check_overview(page, held, stuck_id: str) -> None:  # type: ignore[no-untyped-def]
    """The held lock listed (its token never shown), the contention alert, the stuck job."""
    page.screenshot(path=str(ARTIFACTS / "1-dashboard.png"), full_page=True)
    locks_table = page.inner_text("#jl-locks")
    assert "order:777" in locks_table and held.token not in page.content()
    assert "contention" in page.inner_text("#jl-alerts")
    stuck_table = page.inner_text("#jl-stuck")
    assert stuck_id in stuck_table and "past its timeout" in stuck_table


def _force_release(page, rconn, held) -> None:  # type: ignore[no-untyped-def]
    """Release ``order:777`` from its row: the confirmation page changes nothing, the release
    with a reason does, and says so."""
    page.click("#jl-locks tr:has-text('order:777') a.jl-release")
    page.wait_for_selector("#jl-release")
    page.screenshot(path=str(ARTIFACTS / "2-confirm.png"), full_page=True)
    assert rconn.exists(held.key), "the confirmation page changes nothing"
    page.fill("#jl-reason", "stuck refund, ticket OPS-7")
    page.click("#jl-confirm")
    page.wait_for_selector("#joblock-dashboard")
    page.screenshot(path=str(ARTIFACTS / "3-released.png"), full_page=True)
    assert "Released order:777" in page.inner_text("ul.messagelist")


def test_dashboard_in_a_real_browser(live_server, rconn, settings):
    if not shutil.which(CHROMIUM):
        raise RuntimeError(f"{CHROMIUM} not found: apt-get install chromium (see .ci/run)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    admin = User.objects.create_superuser("ops", "ops@example.com", "correct horse")
    workers = Workers()
    held = lock("order:777", ttl=30)
    try:
        stuck = _stuck_job(rconn, workers)
        _contended_lock_and_metrics(rconn, held)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
            )
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            _log_in(page, live_server.url)
            _check_overview(page, held, stuck.id)
            _check_polish(page, live_server.url, stuck.id)
            _check_timeline(page)
            _check_chart_text_fits(page)
            _check_dark_and_narrow(page)
            _force_release(page, rconn, held)
            browser.close()
    finally:
        workers.stop()
    assert not rconn.exists(held.key)
    from django_joblock.models import LockAudit

    audit = LockAudit.objects.get()
    assert audit.user == admin and audit.reason == "stuck refund, ticket OPS-7"
    assert held.release() is False

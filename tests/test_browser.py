"""A real browser (Playwright driving Debian's headless chromium) walks the dashboard:
log in, see a contended lock and a stuck job, force-release the lock with a reason.

Screenshots go to ``artifacts/`` (git-ignored). Never downloads a browser: it needs
``/usr/bin/chromium`` (``apt-get install chromium``; ``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from django.contrib.auth.models import User

from django_joblock import lock, metrics
from tests import jobs
from tests.harness import wait_for
from tests.workers import Workers

pytestmark = pytest.mark.django_db(transaction=True)

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
CHROMIUM = os.environ.get("JOBLOCK_CHROMIUM", "/usr/bin/chromium")


def _stuck_job(rconn, workers: Workers):  # type: ignore[no-untyped-def]
    """A job left 'started' by a worker and horse that were SIGKILLed, past its timeout."""
    worker = workers.start()
    job = jobs.hold_resource.enqueue((42, "stuck", 60.0), job_timeout=2)
    assert wait_for(lambda: rconn.get("test:pid:stuck"), 20), workers.logs()
    os.kill(int(rconn.get("test:pid:stuck")), signal.SIGKILL)
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(10)
    time.sleep(2.5)  # past its 2 s timeout, still in RQ's started registry
    return job


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
        assert held.acquire()
        for _ in range(25):  # contention on the held lock
            assert not lock("order:777").acquire()
        metrics.flush_now()
        assert wait_for(lambda: rconn.zcard("joblock:active:order"), 3)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM,
                headless=True,
                args=[
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                ],
            )
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{live_server.url}/admin/login/?next=/admin/django_joblock/dashboard/")
            page.fill("#id_username", "ops")
            page.fill("#id_password", "correct horse")
            page.click("input[type=submit]")
            page.wait_for_selector("#joblock-dashboard")
            page.screenshot(path=str(ARTIFACTS / "1-dashboard.png"), full_page=True)
            locks_table = page.inner_text("#jl-locks")
            assert "order:777" in locks_table and held.token not in page.content()
            assert "contention" in page.inner_text("#jl-alerts")
            stuck_table = page.inner_text("#jl-stuck")
            assert stuck.id in stuck_table and "past its timeout" in stuck_table
            page.click("#jl-locks tr:has-text('order:777') a.jl-release")
            page.wait_for_selector("#jl-release")
            page.screenshot(path=str(ARTIFACTS / "2-confirm.png"), full_page=True)
            assert rconn.exists(held.key), "the confirmation page changes nothing"
            page.fill("#jl-reason", "stuck refund, ticket OPS-7")
            page.click("#jl-confirm")
            page.wait_for_selector("#joblock-dashboard")
            page.screenshot(path=str(ARTIFACTS / "3-released.png"), full_page=True)
            assert "Released order:777" in page.inner_text("ul.messagelist")
            browser.close()
    finally:
        workers.stop()
    assert not rconn.exists(held.key)
    from django_joblock.models import LockAudit

    audit = LockAudit.objects.get()
    assert audit.user == admin and audit.reason == "stuck refund, ticket OPS-7"
    assert held.release() is False

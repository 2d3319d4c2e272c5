"""The main job, end to end: ``manage.py joblock_demo --short`` on the example site, with real
worker processes, a killed and a paused work horse, a Django task (``@locked_task``) enqueued
twice, and its report's invariants."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import harness

pytestmark = pytest.mark.slow  # runs the demo: worker processes

ROOT = Path(__file__).resolve().parent.parent


def test_demo_short_run_reports_all_invariants(tmp_path, redis_server):
    env = dict(os.environ, REDIS_URL=harness.redis_url(), EXAMPLE_DB=str(tmp_path / "demo.db"))
    env.pop("DJANGO_SETTINGS_MODULE", None)  # manage.py uses example_site.settings
    done = subprocess.run(
        [sys.executable, "manage.py", "joblock_demo", "--short"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    report = done.stdout
    assert done.returncode == 0, report[-4000:] + done.stderr[-4000:]
    assert "All invariants hold." in report
    for line in (
        "PASS every refund applied exactly once",
        "PASS order balances equal the sum of their refunds",
        "PASS one receipt e-mail per order",
        "PASS overlaps of committed critical sections",
        "PASS no job lost or left failed",
        "PASS a Django task (@locked_task) enqueued twice applied once",
        "PASS faults really injected",
    ):
        assert line in report, report
    assert "FAIL" not in report
    # Negative control inside the run: duplicates really arrived and were blocked.
    blocked = next(line for line in report.splitlines() if "duplicates blocked" in line)
    assert int(blocked.split()[-1]) > 0
    task = next(line for line in report.splitlines() if "Django task" in line)
    assert task.endswith("2 enqueues: SUCCESSFUL, SUCCESSFUL; ran + replayed"), task

"""The failover chaos run inside the suite (issue 16): locks on a real Sentinel setup whose
primary dies holding locks its replica never heard of.

Each run is ``python -m tests.chaos.failover`` in a subprocess (its own Sentinel setup, queue
Redis, throwaway PostgreSQL database and real RQ workers); PostgreSQL-only, like the chaos run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent

pytestmark = pytest.mark.chaos


def run_failover(tmp_path: Path, *args: str) -> dict[str, object]:
    out = tmp_path / "report.json"
    env = dict(os.environ)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    if "sqlite" in env.get("DATABASE_URL", "") or not env.get("DATABASE_URL"):
        env["DATABASE_URL"] = "postgres://postgres@127.0.0.1:5432/postgres"
    done = subprocess.run(
        [sys.executable, "-m", "tests.chaos.failover", "--json", str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    report["_exit"] = done.returncode
    report["_stdout"] = done.stdout[-3000:]
    return report


@pytest.mark.parametrize("acks", [0, 1])
def test_failover_that_forgets_locks_does_no_damage(tmp_path, acks):
    report = run_failover(tmp_path, "--replica-acks", str(acks))
    assert report["_exit"] == 0, report["_stdout"]
    assert report["double_effects"] == 0
    assert report["lost_jobs"] == 0 and report["lost_updates_resources"] == 0
    assert report["stale_writes_accepted"] == 0
    assert report["drained"] is True
    assert any("Sentinel failover" in fault for fault in report["faults"])  # type: ignore[attr-defined]
    if acks == 0:
        # The fault bit: the primary died holding locks the promoted replica never had, and
        # the heartbeat's abort or the fence did the work.
        assert report["locks_forgotten_by_failover"] > 0  # type: ignore[operator]
        assert report["locks_lost"] + report["stale_writes_rejected"] > 0  # type: ignore[operator]


def test_failover_negative_control_without_fencing_and_idempotency_shows_damage(tmp_path):
    report = run_failover(tmp_path, "--negative")
    assert report["_exit"] == 0, report["_stdout"]
    assert report["verdict"].startswith("VALID")  # type: ignore[union-attr]
    assert report["double_effects"] + report["lost_updates_resources"] > 0  # type: ignore[operator]

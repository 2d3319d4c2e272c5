"""The short chaos run inside the suite: no damage with the protections, damage without; for
RQ jobs (``@locked_job``) and for Django tasks on django-joblock's RQ backend (``@locked_task``;
the negative control: a plain ``@task``) alike.

Each run is ``python -m tests.chaos.run`` in a subprocess (its own redis-server with an
append-only file, a TCP proxy, a throwaway PostgreSQL database, real RQ workers). It needs
PostgreSQL (``DATABASE_URL``, default postgres://postgres@127.0.0.1:5432/postgres) whatever
database the rest of the suite uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def run_chaos(tmp_path: Path, *args: str) -> dict[str, object]:
    return run_module(tmp_path, "tests.chaos.run", "--short", *args)


def run_module(tmp_path: Path, module: str, *args: str) -> dict[str, object]:
    """``python -m module --json ... args`` in a subprocess on PostgreSQL; its JSON report,
    with its exit status (``_exit``) and the end of its output (``_stdout``)."""
    out = tmp_path / "report.json"
    env = dict(os.environ)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    if "sqlite" in env.get("DATABASE_URL", "") or not env.get("DATABASE_URL"):
        env["DATABASE_URL"] = "postgres://postgres@127.0.0.1:5432/postgres"
    done = subprocess.run(
        [sys.executable, "-m", module, "--json", str(out), *args],
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


def test_short_chaos_run_loses_nothing_and_applies_nothing_twice(tmp_path):
    report = run_chaos(tmp_path)
    assert report["_exit"] == 0, report["_stdout"]
    assert report["double_effects"] == 0
    assert report["lost_jobs"] == 0 and report["lost_updates_resources"] == 0
    assert report["stale_writes_accepted"] == 0
    assert report["drained"] is True
    assert report["effects_applied_once"] == report["logical_jobs"]
    phases: dict = report["phases"]  # type: ignore[assignment]
    tasks = phases["tasks"]  # the Tasks phase ran, and on its own is whole too
    assert tasks["logical_jobs"] > 0 and tasks["applied_once"] == tasks["logical_jobs"], tasks
    faults = " ".join(report["faults"])  # type: ignore[arg-type]
    for fault in ("SIGKILL worker parent", "Redis restarted", "black hole"):
        assert fault in faults, faults
    assert report["duplicates_blocked"] > 0, "duplicate deliveries really arrived"


def test_negative_control_without_fencing_and_idempotency_shows_damage(tmp_path):
    report = run_chaos(tmp_path, "--negative", "--bound", "90")
    assert report["_exit"] == 0, report["_stdout"]
    assert report["verdict"].startswith("VALID")  # type: ignore[union-attr]
    assert report["double_effects"] + report["lost_updates_resources"] > 0  # type: ignore[operator]
    tasks = report["phases"]["tasks"]  # type: ignore[index]
    assert tasks["double_effects"] + tasks["lost_updates_resources"] > 0, "a plain @task shows it"

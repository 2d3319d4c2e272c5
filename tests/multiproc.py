"""Start ``tests.procs`` children and wait for them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start(*args: str) -> subprocess.Popen[str]:
    from django.db import connection

    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings")
    env["JOBLOCK_CHILD_DB_NAME"] = str(connection.settings_dict["NAME"])
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.procs", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_all(client, commands: list[tuple[str, ...]], timeout: float = 120) -> list[str]:  # type: ignore[no-untyped-def]
    """Start every child, wait until all are ready, send ``go``; their stdouts (all exit 0)."""
    procs = [start(*cmd) for cmd in commands]
    deadline = time.monotonic() + timeout
    while int(client.get("test:ready") or 0) < len(procs):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.01)
    client.set("test:go", 1)
    failures, outputs = [], []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        outputs.append(out)
        if proc.returncode != 0:
            failures.append(f"exit {proc.returncode}: {err[-2000:]}")
    assert not failures, "\n".join(failures)
    return outputs

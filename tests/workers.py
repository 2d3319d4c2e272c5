"""Real RQ worker processes for the tests: ``python -m django joblock_worker`` (or django-rq's
``rqworker``) on the test settings, test Redis and test database."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rq.job import Job, JobStatus

ROOT = Path(__file__).resolve().parent.parent


class Workers:
    """Starts workers and stops every one of them (and their horses) at the end."""

    def __init__(
        self, joblock: dict[str, Any] | None = None, extra_args: list[str] | None = None
    ) -> None:
        self.joblock = joblock or {}
        self.extra_args = list(extra_args or [])  # appended to every worker's command line
        self.procs: list[subprocess.Popen[str]] = []

    def env(self) -> dict[str, str]:
        from django.db import connection

        env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings")
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["JOBLOCK_CHILD_DB_NAME"] = str(connection.settings_dict["NAME"])
        env["JOBLOCK_TEST_SETTINGS"] = json.dumps(self.joblock)
        return env

    def start(
        self,
        *queues: str,
        simple: bool = False,
        scheduler: bool = False,
        burst: bool = False,
        command: str = "joblock_worker",
    ) -> subprocess.Popen[str]:
        args = [sys.executable, "-m", "django", command, *(queues or ("default",))]
        if simple:
            args.append(
                "--simple" if command == "joblock_worker" else "--worker-class=rq.SimpleWorker"
            )
        elif command == "rqworker":  # the django-rq way docs/jobs.md gives
            args.append("--worker-class=django_joblock.worker.JoblockWorker")
        if scheduler:
            args.append("--with-scheduler")
        if burst:
            args.append("--burst")
        args += self.extra_args
        log = open(ROOT / f".worker-{len(self.procs)}.log", "w")
        proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the worker and its horses
                except ProcessLookupError:
                    pass
                proc.wait(10)

    def logs(self) -> str:
        return "\n".join(
            (ROOT / f".worker-{i}.log").read_text()[-3000:] for i in range(len(self.procs))
        )


def wait_status(job: Job, statuses: set[JobStatus], timeout: float) -> JobStatus:
    """Poll until the job reaches one of ``statuses``; fail with its last status otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        status = job.get_status(refresh=True)
        if status in statuses:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job.id} still {status} after {timeout}s")
        time.sleep(0.05)


def intervals(client: Any) -> dict[str, tuple[float, float]]:
    """label -> (start, end) from the jobs' interval log."""
    found = {}
    for raw in client.lrange("test:intervals", 0, -1):
        label, start, end = raw.decode().rsplit(":", 2)
        found[label] = (float(start), float(end))
    return found

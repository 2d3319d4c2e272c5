"""Real RQ worker processes for the tests: ``python -m django joblock_worker`` (or django-rq's
``rqworker``) on the test settings, test Redis and test database, started and stopped by
:class:`~tests.procs.workers.WorkerProcesses`, logging under pytest's temporary
directory (never into the repository)."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from rq.job import Job, JobStatus

from tests.harness import ROOT, child_env
from tests.procs.workers import WorkerProcesses, joblock_worker_args

__all__ = ["DONE", "ROOT", "Workers", "exited", "intervals", "pid_of", "wait_status"]

#: The statuses a job ends in.
DONE = {JobStatus.FINISHED, JobStatus.FAILED}

#: Where worker logs go: set once per run by the session fixture in tests/conftest.py.
LOG_ROOT: Path | None = None


class Workers:
    """Starts workers and stops every one of them (and their horses) at the end."""

    def __init__(
        self, joblock: dict[str, Any] | None = None, extra_args: list[str] | None = None
    ) -> None:
        self.joblock = joblock or {}
        self.extra_args = list(extra_args or [])  # appended to every worker's command line
        log_dir = tempfile.mkdtemp(prefix="workers-", dir=LOG_ROOT)
        self.crew = WorkerProcesses(cwd=ROOT, log_dir=log_dir)

    @property
    def procs(self) -> list[subprocess.Popen[str]]:
        return self.crew.procs

    @property
    def log_paths(self) -> list[Path]:
        return self.crew.log_paths

    def env(self) -> dict[str, str]:
        return child_env(self.joblock)

    def start(
        self,
        *queues: str,
        simple: bool = False,
        scheduler: bool = False,
        burst: bool = False,
        command: str = "joblock_worker",
    ) -> subprocess.Popen[str]:
        extra = []
        if simple:
            extra.append(
                "--simple" if command == "joblock_worker" else "--worker-class=rq.SimpleWorker"
            )
        elif command == "rqworker":  # the django-rq way docs/jobs.md gives
            extra.append("--worker-class=django_joblock.worker.JoblockWorker")
        args = joblock_worker_args(
            *queues,
            command=command,
            with_scheduler=scheduler,
            burst=burst,
            extra=[*extra, *self.extra_args],
        )
        return self.crew.start(args, env=self.env())

    def stop(self) -> None:
        self.crew.stop()

    def logs(self, tail: int = 3000) -> str:
        return self.crew.logs(tail)


def wait_status(
    job: Job, statuses: set[JobStatus], timeout: float, crew: Workers | None = None
) -> JobStatus:
    """Poll until the job reaches one of ``statuses``; fail with its last status otherwise
    (and ``crew``'s logs, when given)."""
    deadline = time.monotonic() + timeout
    while True:
        status = job.get_status(refresh=True)
        if status in statuses:
            return status
        if time.monotonic() > deadline:
            logs = f"\n{crew.logs()}" if crew is not None else ""
            raise AssertionError(f"job {job.id} still {status} after {timeout}s{logs}")
        time.sleep(0.05)


def exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaped (PID 1 of a container may never reap orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # (the latter: gone between open and read)
        return True


def pid_of(client: Any, label: str, timeout: float = 20) -> int:
    """The pid a test job wrote under ``test:pid:<label>`` (it has started), within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not client.get(f"test:pid:{label}"):
        if time.monotonic() > deadline:
            raise AssertionError(f"{label} never started")
        time.sleep(0.01)
    return int(client.get(f"test:pid:{label}"))


def intervals(client: Any) -> dict[str, tuple[float, float]]:
    """label -> (start, end) from the jobs' interval log."""
    found = {}
    for raw in client.lrange("test:intervals", 0, -1):
        label, start, end = raw.decode().rsplit(":", 2)
        found[label] = (float(start), float(end))
    return found

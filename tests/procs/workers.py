"""Real RQ worker processes for test suites, demos and benchmarks.

:func:`joblock_worker_args` builds the command line of ``manage.py joblock_worker`` (or of
django-rq's ``rqworker``, or any Django command); :class:`WorkerProcesses` starts such commands
(or any other worker program) as subprocesses with a given environment and working directory,
and stops them together.

Guarantees and failure modes:

- Each process starts in a session (and process group) of its own, so :meth:`~WorkerProcesses.
  stop` reaches the worker, its forked work horses and its scheduler process alike, even a horse
  whose worker was killed before it (an orphan keeps the group). Signals sent from a terminal
  (Ctrl-C) do not reach them; :meth:`~WorkerProcesses.stop` does.
- stdout and stderr of process ``i`` go to ``log_dir / f"worker-{i}.log"``; ``log_dir`` is a
  new temporary directory unless given, never the current directory. Logs are kept after
  :meth:`~WorkerProcesses.stop` (for a report or an assertion message); removing them is the
  owner's choice (:meth:`~WorkerProcesses.remove_logs`).
- :meth:`~WorkerProcesses.start` returns as soon as the process is spawned: it does not wait
  for the worker to listen on its queues. A worker that cannot start exits, and says why in its
  log (see :meth:`~WorkerProcesses.logs`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

#: Seconds :meth:`WorkerProcesses.stop` waits for a process to exit after SIGKILL: the kernel
#: reaps it, which took over 10 s once in CI with three suites on two cores.
KILL_WAIT = 60.0


def joblock_worker_args(
    *queues: str,
    manage_py: str | os.PathLike[str] | None = None,
    command: str = "joblock_worker",
    name: str | None = None,
    with_scheduler: bool = False,
    burst: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of ``joblock_worker QUEUES...`` (default queue ``default``).

    Run as ``python -m django`` (the settings come from ``DJANGO_SETTINGS_MODULE`` in the
    environment) or, with ``manage_py``, as ``python manage.py``; ``python`` is this
    interpreter. ``command`` may name another worker command taking the same options (django-
    rq's ``rqworker``). ``extra`` is appended as given (e.g. ``["--simple"]``).
    """
    args = [sys.executable, *(["-m", "django"] if manage_py is None else [os.fspath(manage_py)])]
    args += [command, *(queues or ("default",))]
    if name is not None:
        args += ["--name", name]
    if with_scheduler:
        args.append("--with-scheduler")
    if burst:
        args.append("--burst")
    return [*args, *extra]


class WorkerProcesses:
    """Worker subprocesses started by one owner, stopped together (see the module docs).

    ``env``: the environment of every process (default: this process's); ``cwd``: their working
    directory (default: this process's); ``log_dir``: where their logs go (default: a new
    temporary directory). ``procs`` lists every process started, in order, including those that
    have exited; ``log_paths[i]`` is the log of ``procs[i]``.
    """

    def __init__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.log_dir = Path(
            tempfile.mkdtemp(prefix="joblock-workers-") if log_dir is None else log_dir
        )
        self.procs: list[subprocess.Popen[str]] = []
        self.log_paths: list[Path] = []

    def start(
        self, args: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """Spawn ``args`` (``env`` replaces the owner's environment for this one process)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"worker-{len(self.procs)}.log"
        chosen = env if env is not None else self.env
        with path.open("w") as log:  # the child has its own copy of the descriptor
            proc = subprocess.Popen(
                list(args),
                cwd=self.cwd,
                env=dict(chosen) if chosen is not None else None,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        self.procs.append(proc)
        self.log_paths.append(path)
        return proc

    def stop(self, grace: float = 0.0) -> None:
        """Stop every process and everything in its process group.

        With ``grace`` > 0, each worker still running is first sent SIGTERM (RQ's warm
        shutdown: the current job finishes, the scheduler gives its lock back) and all of them
        get up to ``grace`` seconds in total to exit. Then each process group is SIGKILLed
        (work horses, scheduler, orphans) and each process waited for (up to ``KILL_WAIT``
        seconds; ``subprocess.TimeoutExpired`` if one is stuck in the kernel that long).
        """
        if grace > 0:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for proc in self.procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # the group is gone (PermissionError: the id was reused elsewhere)
            proc.wait(KILL_WAIT)

    def logs(self, tail: int = 3000) -> str:
        """The last ``tail`` characters of every log, each under a ``--- name ---`` line."""
        parts = []
        for path in self.log_paths:
            try:
                text = path.read_text(errors="replace")[-tail:]
            except OSError as exc:
                text = f"(unreadable: {exc})"
            parts.append(f"--- {path.name} ---\n{text}")
        return "\n".join(parts)

    def remove_logs(self) -> None:
        """Delete ``log_dir`` and everything in it."""
        shutil.rmtree(self.log_dir, ignore_errors=True)

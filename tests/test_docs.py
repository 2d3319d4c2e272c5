"""Every runnable block of README.md and docs/ works as written (see tests/docblocks.py).

The blocks are assembled into a new project (``django-admin startproject``, as the README's
tour does) that imports django-joblock from the *built wheel*, not from this checkout, so the
wheel's templates, static files and migrations are what the project gets. Redis is the test
suite's throwaway server (the README's ``redis://127.0.0.1:6379/0`` is rewritten to it), the
jobs run on a real RQ worker (the tour's ``joblock_worker`` block, with ``--burst``), and
names a block uses without importing are caught by ruff (F821) even where no line runs them.
A development worker (``joblock_worker`` without ``--burst``) runs from the migrations to the
end, as on a developer's machine: docs/testing.md's ``manage.py test`` must pass beside it and
leave the development orders as they were.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from rq import Worker

from tests import docblocks, harness

pytestmark = pytest.mark.slow  # starts processes or servers

README_REDIS = "redis://127.0.0.1:6379/"  # the docs' Redis databases, on the throwaway server
DEV_ORDERS = (
    "from shop.models import Order; print(list(Order.objects.values_list('pk', 'refunded')))"
)
FAILED_JOBS = """
import django_rq
from django.conf import settings
queues = [django_rq.get_queue(name) for name in settings.RQ_QUEUES]
failed = [queue.fetch_job(id) for queue in queues for id in queue.failed_job_registry.get_job_ids()]
print([(job.func_name, getattr(job.latest_result(), "exc_string", "")) for job in failed])
"""
# What the test's project adds to the tour's settings: mail that never leaves the machine
# (Django >= 6.1's startproject already uses the console mailer; older ones default to SMTP).
TEST_SETTINGS = '\nEMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"\n'


def test_every_runnable_block_has_a_directive():
    blocks = docblocks.all_blocks()  # raises DirectiveError naming file:line otherwise
    assert any(block.action == "run" for block in blocks)


def test_a_block_without_a_directive_is_refused(tmp_path):
    doc = tmp_path / "guide.md"
    doc.write_text("Text.\n\n```python\nprint('hi')\n```\n")
    with pytest.raises(docblocks.DirectiveError, match=r"guide\.md:3: a python block without"):
        docblocks.parse(doc)
    doc.write_text("Text.\n<!-- docs: skip an illustration -->\n```python\nprint('hi')\n```\n")
    (block,) = docblocks.parse(doc)
    assert (block.action, block.argument, block.code) == ("skip", "an illustration", "print('hi')")
    doc.write_text("1. Step:\n\n   <!-- docs: run -->\n   ```bash\n   echo  a\n   ```\n")
    (block,) = docblocks.parse(doc)  # inside a list item: indented, dedented for running
    assert (block.action, block.language, block.code) == ("run", "bash", "echo  a")


def _environment(site: Path, venv_bin: Path) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DJANGO_", "PYTHONPATH"))
    }
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(site)  # the unpacked wheel shadows the editable checkout
    return env


def _run(args: list[str], cwd: Path, env: dict[str, str], what: str) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (
        f"{what} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


class _DevWorker:
    """The development worker (``joblock_worker`` without ``--burst``) on the same Redis server,
    started once a block ran the migrations and restarted on new code, as a developer does."""

    def __init__(self, project: Path, env: dict[str, str], log: Path) -> None:
        self.project = project
        self.env = env
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.changed = False  # a block wrote a file since the dev worker started

    def code_changed(self) -> None:
        """A block wrote a file of the project."""
        self.changed = True

    def restart_if_changed(self) -> None:
        """Before a block runs: restart the worker if a block changed a file since it started."""
        if self.proc is not None and self.changed:
            _stop(self.proc, self.log)
            self.proc = _start_dev_worker(self.project, self.env, self.log)
        self.changed = False

    def start_after_migrations(self, command: str) -> None:
        """After a command ran: start the worker if it ran the migrations and none runs yet."""
        if "manage.py migrate" in command and self.proc is None:
            self.proc = _start_dev_worker(self.project, self.env, self.log)

    def stop(self) -> None:
        """Stop it as a developer does; it must have been started."""
        assert self.proc is not None, "no block ran the migrations"
        _stop(self.proc, self.log)

    def kill(self) -> None:
        """Kill it (and its horses and scheduler) if it still runs."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def _patch_settings(project: Path) -> bool:
    """Add ``TEST_SETTINGS`` to the project's settings unless they set ``MAILERS``; False if
    the project has no settings yet."""
    settings_file = project / "mysite" / "settings.py"
    if not settings_file.exists():
        return False
    text = settings_file.read_text()
    if "MAILERS" not in text:
        settings_file.write_text(text + TEST_SETTINGS)
    return True


def _append_file_block(target: Path, code: str, env: dict[str, str], where: str) -> None:
    """Append a ``file`` block's code to its file in the project, and check its names."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as out:
        out.write("\n" + code + "\n")
    _lint([target], env, where)


def _run_block(
    block: docblocks.Block, code: str, project: Path, env: dict[str, str], dev: _DevWorker
) -> None:
    """Run a ``run`` or ``run-as`` block in the project: bash in bash, python in ``manage.py
    shell`` (its names checked first). docs/testing.md's tests run beside the dev worker and
    must not touch development data."""
    command = block.argument if block.action == "run-as" else code
    shell = [sys.executable, "manage.py", "shell", "-c", DEV_ORDERS]
    before = _run(shell, project, env, "dev orders") if "manage.py test" in command else ""
    if block.language == "bash" or block.action == "run-as":
        _run(["bash", "-euo", "pipefail", "-c", command], project, env, block.where)
        if before:
            assert _run(shell, project, env, "dev orders") == before, "a test job ran in dev"
        dev.start_after_migrations(command)
    else:
        script = project / "_block.py"
        script.write_text(code + "\n")
        _lint([script], env, block.where)
        _run(
            [sys.executable, "manage.py", "shell", "-c", script.read_text()],
            project,
            env,
            block.where,
        )


def test_readme_and_docs_blocks_run_in_a_new_project(tmp_path, built_wheel_site, redis_server):
    venv_bin = Path(sys.executable).parent
    project = tmp_path / "project"
    project.mkdir()
    env = _environment(built_wheel_site, venv_bin)
    url = harness.redis_url().rsplit("/", 1)[0] + "/"
    patched = False
    ran = 0
    # A development worker on the same Redis server from the migrations on, as a developer has.
    dev = _DevWorker(project, env, tmp_path / "dev-worker.log")
    try:
        for block in docblocks.all_blocks():
            code = block.code.replace(README_REDIS, url)
            if not patched:
                patched = _patch_settings(project)
            if block.action == "skip":
                continue
            if block.action == "file":
                _append_file_block(project / block.argument, code, env, block.where)
                dev.code_changed()
                continue
            dev.restart_if_changed()
            _run_block(block, code, project, env, dev)
            ran += 1
        dev.stop()
    finally:
        dev.kill()
    assert ran >= 5, "the tour's blocks did not run"
    _lint(sorted(project.rglob("*.py")), env, "the assembled project")
    _run([sys.executable, "manage.py", "check"], project, env, "manage.py check (urls too)")
    failed = _run(
        [sys.executable, "manage.py", "shell", "-c", FAILED_JOBS], project, env, "failed jobs"
    )
    assert failed.strip().splitlines()[-1] == "[]", f"jobs from the docs failed: {failed[-3000:]}"


def _start_dev_worker(project: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "manage.py", "joblock_worker", "default", "--with-scheduler"],
        cwd=project,
        env=env,
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _until_idle(worker: subprocess.Popen[bytes], log: Path) -> None:
    """Wait until the dev worker waits for jobs (RQ says it is ``idle``), as a developer
    stops it. A SIGTERM during its start-up may kill it outright (exit -15, once in CI): RQ
    installs its signal handlers only after starting its scheduler, by a fork."""
    servers = [
        redis.Redis.from_url(f"{harness.redis_url().rsplit('/', 1)[0]}/{db}") for db in range(16)
    ]
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            assert worker.poll() is None, f"the dev worker died: {log.read_text()[-3000:]}"
            for server in servers:
                found = Worker.all(connection=server)
                if any(w.pid == worker.pid and w.get_state() == "idle" for w in found):
                    return
            time.sleep(0.1)
    finally:
        for server in servers:
            server.close()
    raise AssertionError(f"the dev worker never waited for jobs: {log.read_text()[-3000:]}")


def _stop(worker: subprocess.Popen[bytes], log: Path) -> None:
    _until_idle(worker, log)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0, log.read_text()[-3000:]


def _lint(files: list[Path], env: dict[str, str], what: str) -> None:
    ruff = shutil.which("ruff", path=env["PATH"])
    assert ruff, "ruff (in the test dependencies) is needed to check the docs' names"
    _run(
        [ruff, "check", "--isolated", "--no-cache", "--select", "F821", *map(str, files)],
        files[0].parent,
        env,
        f"undefined names in {what}",
    )
